"""The keys of agents as clients (``--agent``, :mod:`posttrain.agents`; docs/agents.md)."""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.config.errors import check


@dataclass
class AgentFields:
    agent: str | None = None
    """Episodes played by an agent program of your own: file.py:fn or module:fn, called as
    fn(client, row) for every row and sample with an openai client of the run's
    OpenAI-compatible endpoint (its base_url and an api_key that names the episode); fn
    returns the reward (a number, a dict of named terms, or None for the --reward terms);
    every request is trained token for token (docs/agents.md). builtin = the built-in
    multi-turn task as an openai-SDK agent. Needs the openai package (posttrain[agents])."""
    agent_concurrency: int = 256
    """agent: episodes whose agents run at once (threads); a step's episodes beyond it
    wait for a free one (then each turn is sampled in more, smaller batches)."""
    agent_timeout: float = 300.0
    """agent: seconds of wall clock an episode's agent may take, requests included."""
    tool_parser: str = "auto"
    """agent: how tool calls are read from the model's turns: auto (from the chat template),
    hermes, llama3_json, mistral, plain or ask (builtin's)."""

    def _check_agent(self) -> None:
        from posttrain.agents.parsers import PARSERS

        if not self.agent:
            self.refuse(("agent_concurrency", "agent_timeout", "tool_parser"),
                        "runs without --agent")
            return
        check(not (self.env or self.tools), "--agent plays the episodes; --env and --tools "
              "are environments of the episode loop: choose one")
        check(self.agent == "builtin" or self.data is not None,
              f"--agent {self.agent} needs --data: the rows its episodes are played on")
        check(self.agent_concurrency >= 1 and self.agent_timeout > 0
              and self.max_episode_tokens >= 1, "agent_concurrency and max_episode_tokens "
              "must be ≥ 1 and agent_timeout > 0")
        check(self.tool_parser in ("auto", *PARSERS),
              f"tool_parser must be auto or one of {', '.join(PARSERS)}")
        self.refuse(("env_kwargs", "env_timeout", "env_workers", "max_turns",
                     "tool_error_reward"),
                    "--agent (the agent program plays the episode; max_episode_tokens "
                    "bounds it)")
        if self.agent == "builtin" and self.model == "builtin":
            self.model = "builtin-episodes"  # the built-in model SFT'd on the task's protocol
