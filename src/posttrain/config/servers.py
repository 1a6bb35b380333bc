"""The keys of rollouts served by vLLM servers (``--rollout_backend vllm_server``), shared by
every on-policy command (docs/engines.md, "Rollout servers")."""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.config.errors import check


@dataclass
class RolloutServerFields:
    rollout_servers: str | None = None
    """rollout_backend vllm_server: running vLLM servers to sample from, comma-separated
    URLs (http://host:port), started as docs/engines.md shows; exclusive with
    launch_rollout_servers. Their key (their VLLM_API_KEY and POSTTRAIN_ROLLOUT_KEY) is read
    from this environment's POSTTRAIN_ROLLOUT_KEY, never from a config file."""
    launch_rollout_servers: int = 0
    """rollout_backend vllm_server: start this many vLLM servers from the policy's weights
    (on 127.0.0.1, each checking a key made for the run; logs in the run directory's
    rollout-servers/), and stop them when the run ends."""
    rollout_server_devices: str | None = None
    """With launch_rollout_servers: each server's CUDA_VISIBLE_DEVICES, separated by ';'
    (e.g. "1;2" or "2,3;4,5"); none = the servers see what the run sees."""
    rollout_server_args: str = ""
    """With launch_rollout_servers: more arguments for every server's vLLM command line
    (e.g. "--tensor-parallel-size 2 --gpu-memory-utilization 0.8")."""
    rollout_timeout: float = 120.0
    """Seconds any one call to a rollout server may take (a sample, a weight bucket): a
    server past it is named and dropped, its requests go to the others."""
    rollout_server_startup: float = 900.0
    """Seconds a rollout server may take to answer its first health check."""
    rollout_lora_push: str = "auto"
    """With lora_rank: what a push sends the servers. adapter: the adapter alone (the
    servers hold the base weights and load it through vLLM's LoRA API; launched servers
    are started with --enable-lora, servers of your own need --enable-lora and
    VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, on this host); merged: the merged weights
    through the RL API, as for full fine-tuning; auto = adapter for launched servers,
    merged for servers of your own."""
    rollout_transfer: str = "posttrain"
    """How a push moves the weights to the servers. posttrain: safetensors buckets, by file
    in /dev/shm to servers on this host, inline in the request to others (any device; the
    path this project tests); nccl: vLLM's NCCL transport, GPU to GPU (rank 0 on CUDA, vLLM
    installed beside the trainer, servers started with --weight-transfer-config
    '{"backend": "nccl"}', as launched ones then are; they reach rank 0 at 127.0.0.1 when
    all are local, else at POSTTRAIN_NCCL_ADDRESS or this host's address toward them)."""

    def _check_servers(self) -> None:
        server_keys = ("rollout_servers", "launch_rollout_servers", "rollout_server_devices",
                       "rollout_server_args", "rollout_lora_push", "rollout_transfer")
        if self.rollout_backend != "vllm_server":
            self.refuse(server_keys, f"rollout_backend={self.rollout_backend} (they set the "
                        "vllm_server engine)")
            return
        check(bool(self.rollout_servers) != (self.launch_rollout_servers > 0),
              "rollout_backend=vllm_server needs either rollout_servers (URLs of running "
              "servers) or launch_rollout_servers N (servers the run starts)")
        check(self.launch_rollout_servers >= 0, "launch_rollout_servers must be ≥ 0")
        check(self.rollout_transfer in ("posttrain", "nccl"),
              "rollout_transfer must be posttrain or nccl")
        check(self.rollout_lora_push in ("auto", "adapter", "merged"),
              "rollout_lora_push must be auto, adapter or merged")
        if not self.lora_rank:
            self.refuse(("rollout_lora_push",), "a run without LoRA (lora_rank 0)")
        elif self.rollout_lora_push == "adapter":
            check(self.parallel != "fsdp", "rollout_lora_push=adapter saves the adapter from "
                  "one process; with parallel fsdp use rollout_lora_push merged")
        check(self.lora_push != "adapter" or self.lora_rank <= 512, "rollout_lora_push="
              "adapter: vLLM serves LoRA ranks up to 512; use rollout_lora_push merged")
        check(self.rollout_timeout > 0 and self.rollout_server_startup > 0,
              "rollout_timeout and rollout_server_startup must be > 0")
        if self.rollout_servers:
            self.refuse(("rollout_server_devices", "rollout_server_args"),
                        "rollout_servers (servers the run did not start)")
            for url in self.server_urls:
                check(url.startswith(("http://", "https://")),
                      f"rollout_servers: {url!r} is not an http(s):// URL")
        else:
            import shlex

            owned = {"--host", "--port", "--api-key", "--model"}
            for arg in shlex.split(self.rollout_server_args):
                check(arg.split("=")[0] not in owned, f"rollout_server_args: {arg.split('=')[0]}"
                      " is the run's to set (launched servers listen on 127.0.0.1 with the "
                      "run's key and model)")

            devices = self.server_devices
            check(devices is None or len(devices) == self.launch_rollout_servers,
                  f"rollout_server_devices names {len(devices or [])} device sets for "
                  f"{self.launch_rollout_servers} servers")

    @property
    def lora_push(self) -> str | None:
        """What a LoRA run's push sends (``rollout_lora_push`` decided): adapter or merged;
        None without LoRA."""
        if not self.lora_rank:
            return None
        if self.rollout_lora_push != "auto":
            return self.rollout_lora_push
        launched = self.launch_rollout_servers > 0 and self.parallel != "fsdp"
        return "adapter" if launched else "merged"

    @property
    def server_urls(self) -> list[str]:
        return [u.strip() for u in (self.rollout_servers or "").split(",") if u.strip()]

    @property
    def server_devices(self) -> list[str] | None:
        if not self.rollout_server_devices:
            return None
        return [d.strip() for d in self.rollout_server_devices.split(";")]
