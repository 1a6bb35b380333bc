"""Multi-turn episodes: the environment protocol (:mod:`.env`), turns as token ids that are
appended and never re-tokenised (:mod:`.render`), the loop that runs many episodes at once
over a rollout engine (:mod:`.loop`), the tool-calling environment (:mod:`.tools`), and the
daemon threads their calls run on, past whose timeout a call cannot hold the process
(:mod:`.calls`). A single-turn completion is the one-turn episode; the trainers take both
as a :class:`~posttrain.rollout.Rollout`."""

from posttrain.episodes.env import EnvError, EnvSpec, Episode, load_object, parse_kwargs
from posttrain.episodes.loop import EpisodeLimits, Episodes, run_episodes, score_episodes
from posttrain.episodes.render import Renderer, TemplateError
from posttrain.episodes.tools import ToolEnv, load_tools, parse_calls, tool_spec

__all__ = ["EnvError", "EnvSpec", "Episode", "EpisodeLimits", "Episodes", "Renderer",
           "TemplateError", "ToolEnv", "load_object", "load_tools", "parse_calls", "parse_kwargs",
           "run_episodes", "score_episodes", "tool_spec"]
