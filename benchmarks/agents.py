"""Seconds per episode of ``--agent builtin`` against ``--env builtin`` on the same engine:
the built-in multi-turn task (``builtin-episodes``, 2 requests an episode), one step's
rollout (``ExperienceMaker.collect``: sampling and scoring), the same seeds, the modes
alternating in one process, medians.

Modes: ``env`` (the episode loop calls the environment in process); ``agent`` (the built-in
agent through the endpoint with the ``openai`` SDK, every episode in flight at once);
``agent64`` (the same, 64 episodes in flight); ``agent_http`` (the same agent written with
``http.client``: the endpoint's own cost without the SDK's); ``agent_async`` (the same
agent as an ``async def`` with the SDK's ``AsyncOpenAI`` client); ``sdk_floor`` (the same
agent and SDK client, every answer canned and handed back by an in-memory transport: no
endpoint, no model — the SDK's own work for the episode's two requests, a floor under
``agent`` that no endpoint can go below).

Usage: python benchmarks/agents.py [--engine lean] [--rows 32] [--group 4] [--repeats 5]
       [--hidden 512]
Prints one JSON line per mode and a Markdown table.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import tempfile
import time
import urllib.parse

import torch


def http_agent(client, row):
    """:func:`posttrain.builtin.agent.lookup_agent` over plain ``http.client``."""
    from posttrain.builtin.agent import OPERAND

    url = urllib.parse.urlsplit(str(client.base_url))
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    headers = {"Authorization": f"Bearer {client.api_key}",
               "Content-Type": "application/json"}
    messages = [{"role": "user", "content": f"{row['a']}+?"}]
    try:
        for _ in range(2):
            body = json.dumps({"model": "posttrain-policy", "messages": messages,
                               "tools": [OPERAND]})
            conn.request("POST", url.path.rstrip("/") + "/chat/completions", body, headers)
            message = json.loads(conn.getresponse().read())["choices"][0]["message"]
            if not message.get("tool_calls"):
                return 1.0 if (message["content"] or "").strip() == str(row["answer"]) else 0.0
            messages.append(message)
            for call in message["tool_calls"]:
                messages.append({"role": "tool", "tool_call_id": call["id"],
                                 "content": str(row["b"])})
        return 0.0
    finally:
        conn.close()


async def async_agent(client, row):
    """:func:`posttrain.builtin.agent.lookup_agent` as a coroutine function (an
    ``openai.AsyncOpenAI`` client)."""
    from posttrain.builtin.agent import OPERAND, answered

    messages = [{"role": "user", "content": f"{row['a']}+?"}]
    for _ in range(2):
        reply = await client.chat.completions.create(model="posttrain-policy",
                                                     messages=messages, tools=[OPERAND])
        reward = answered(reply.choices[0].message, messages, row)
        if reward is not None:
            return reward
    return 0.0


class SdkFloor:
    """``--agent builtin``'s episodes with every answer canned (the endpoint's answers'
    shape: a call of ``operand``, then the sum), through the SDK's client and an in-memory
    transport. ``experience.collect`` runs the episodes one after another."""

    def __init__(self, args):
        import openai

        from posttrain.builtin.episodes import rows

        client = openai.DefaultHttpxClient.__mro__[1]  # (the httpx Client the SDK uses)
        self.httpx = sys.modules[client.__module__.split(".")[0]]
        self.client = openai.OpenAI(base_url="http://127.0.0.1:9/v1", api_key="floor",
                                    http_client=client(
                                        transport=self.httpx.MockTransport(self._answer)))
        self.rows = rows(args.rows, "train")
        self.group, self.experience = args.group, self
        self.turn, self.row = 0, None

    def _answer(self, request):
        body = json.loads(request.content)
        ids = list(range(3 * len(body["messages"])))
        asked, self.turn = self.turn == 0, self.turn ^ 1  # (a call first, then the sum)
        message = {"role": "assistant", "content": "", "tool_calls": [{
            "id": "call_0", "type": "function",
            "function": {"name": "operand", "arguments": "{}"}}]} if asked else {
            "role": "assistant", "content": str(self.row["answer"])}
        answer = {"id": "posttrain-floor", "created": 0, "model": "posttrain-policy",
                  "usage": {"prompt_tokens": len(ids), "completion_tokens": 2,
                            "total_tokens": len(ids) + 2},
                  "prompt_token_ids": ids, "system_fingerprint": "posttrain-v0",
                  "object": "chat.completion", "choices": [{
                      "index": 0, "message": message, "logprobs": None, "token_ids": [5, 6],
                      "finish_reason": "tool_calls" if asked else "stop"}]}
        return self.httpx.Response(200, json=answer)

    def collect(self, step):
        from posttrain.builtin.agent import lookup_agent

        rewards = []
        for row in self.rows:
            for _ in range(self.group):
                self.row, self.turn = row, 0
                rewards.append(lookup_agent(self.client, row))
        assert rewards == [1.0] * len(rewards)  # (both requests made, every episode)
        return None

    def close(self):
        self.client.close()


def maker(mode: str, args, out: str):
    if mode == "sdk_floor":
        return SdkFloor(args)

    from posttrain.config import RLConfig
    from posttrain.trainers.online import RLTrainer

    source = {"env": "builtin"} if mode == "env" else {
        "agent": "builtin", "agent_concurrency": 64 if mode == "agent64" else 1 << 16}
    if mode in ("agent_http", "agent_async"):  # (a user's agent: the task's rows as data)
        from posttrain.builtin.episodes import rows

        data = f"{out}/rows.jsonl"
        with open(data, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows(args.rows * 8, "train"))
        fn = "http_agent" if mode == "agent_http" else "async_agent"
        source.update(agent=f"{__file__}:{fn}", tool_parser="ask", data=data)
    cfg = RLConfig(output_dir=out, **source, model=args.model, max_steps=1,
                   prompts_per_step=args.rows, group_size=args.group, device="cpu",
                   rollout_backend=args.engine, tensorboard=False, max_new_tokens=6,
                   builtin_eval_size=0)
    cfg.validate()
    return RLTrainer(cfg)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", default="lean")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--modes", default="env,agent,agent64,agent_http,agent_async")
    ap.add_argument("--hidden", type=int, default=0,
                    help="time on a random model of this width (8 layers; 512: ~25M) instead "
                         "of builtin-episodes: the same episodes in every mode, sampling "
                         "costlier")
    args = ap.parse_args()
    args.model = "builtin-episodes"
    if args.hidden:
        from pathlib import Path

        from posttrain.builtin.build import init_model

        args.model = tempfile.mkdtemp()
        init_model(Path(args.model), hidden_size=args.hidden,
                   intermediate_size=args.hidden * 11 // 4, num_hidden_layers=8,
                   num_attention_heads=args.hidden // 64, num_key_value_heads=args.hidden // 64)
    torch.set_num_threads(2)
    modes = args.modes.split(",")
    trainers = {m: maker(m, args, tempfile.mkdtemp()) for m in modes}
    times: dict[str, list[float]] = {m: [] for m in modes}
    for m in modes:  # (warm up: the first step compiles and fills caches)
        trainers[m].experience.collect(1)
    for r in range(args.repeats):
        for m in modes if r % 2 == 0 else modes[::-1]:
            t = time.perf_counter()
            exp = trainers[m].experience.collect(r + 2)
            times[m].append(time.perf_counter() - t)
            assert exp is None or len(exp.rollout.prompt_ids) == args.rows * args.group
    episodes = args.rows * args.group
    base = statistics.median(times["env"]) if "env" in times else None
    rows = []
    for m in modes:
        med = statistics.median(times[m])
        row = {"mode": m, "engine": args.engine, "model": args.hidden or "builtin-episodes",
               "episodes": episodes,
               "median_s_per_step": round(med, 4),
               "ms_per_episode": round(1000 * med / episodes, 3),
               "vs_env": round(med / base, 2) if base else None}
        rows.append(row)
        print(json.dumps(row))
    print("\n| mode | s / step | ms / episode | × env |\n|---|---|---|---|")
    for row in rows:
        print(f"| {row['mode']} | {row['median_s_per_step']} | {row['ms_per_episode']} | "
              f"{row['vs_env']} |")
    for t in trainers.values():
        t.close()


if __name__ == "__main__":
    sys.exit(main())
