"""What the learner (:mod:`.trainer`) and a producer process (:mod:`.remote`) both build from
a run's config: its prompt rows and its batch maker. A module of its own, so that neither of
those two imports the other for them."""

from __future__ import annotations

import torch

from posttrain import data as data_mod
from posttrain.builtin import task as builtin_task
from posttrain.rollout.types import stream_seed
from posttrain.trainers.online.experience import ExperienceMaker


def experience_maker(cfg, algo, engine, tok, rewards, train_rows,
                     generator: torch.Generator | None = None) -> ExperienceMaker:
    """The run's batch maker over ``engine`` (the built-in task's exact-answer check as its
    accuracy, whatever the reward); ``generator``: its data order's, else the asynchronous
    producer's own."""
    accuracy = builtin_task.reward if cfg.data is None and not cfg.episodic else None
    if generator is None or cfg.async_staleness:
        # (the learner's generator shuffles minibatches meanwhile)
        generator = torch.Generator().manual_seed(stream_seed(cfg.seed, "producer"))
    return ExperienceMaker(cfg, algo, engine, tok, rewards, train_rows, generator, accuracy)


def rl_rows(cfg, tok) -> tuple[list[dict], list[dict]]:
    """Training and held-out prompts (or episode rows), each prompt checked against
    max_length."""
    if cfg.episodic:  # the environment makes the prompts (the loop checks their length)
        if cfg.data is None:
            from posttrain.builtin import episodes

            return (episodes.rows(cfg.builtin_train_size, "train", cfg.seed),
                    episodes.rows(cfg.builtin_eval_size, "eval", cfg.seed))
        kind = "rl" if cfg.tools else "env"  # (the tool environment reads the prompt)
        return (data_mod.load(cfg.data, kind)[1],
                data_mod.load(cfg.eval_data, kind)[1] if cfg.eval_data else [])
    if cfg.data is None:
        sets = [(data_mod.BUILTIN_SOURCE,
                 builtin_task.rl_rows(cfg.builtin_train_size, "train", cfg.seed)),
                (data_mod.BUILTIN_SOURCE,
                 builtin_task.rl_rows(cfg.builtin_eval_size, "eval", cfg.seed))]
    else:
        sets = [data_mod.load(cfg.data, "rl"),
                data_mod.load(cfg.eval_data, "rl") if cfg.eval_data else ("", [])]
    for name, rows in sets:
        data_mod.check_prompt_lengths(tok, name, rows, cfg.max_new_tokens,
                                      cfg.max_length)
    return sets[0][1], sets[1][1]
