#!/usr/bin/env bash
# One prepared run of the rollout servers on a CUDA machine (vLLM installed beside posttrain),
# from the repository root: benchmarks/rollout_servers.py at ~25M and ~180M (in-process vLLM
# against one launched server, each weight transport: GRPO step and push seconds). With two or more GPUs the trainer takes GPU 0 and the servers GPUs 1 (and 2);
# with one, they share it (each server takes --gpu-memory-utilization 0.3). Logs go to $1
# (default gpu-servers/). Budget: about 8 minutes on one H200.
set -uo pipefail
out="${1:-gpu-servers}"
mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py="${PYTHON:-python3}"
$py -m pip install -q --no-deps --no-build-isolation -e . >"$out/install.log" 2>&1 \
  || echo "editable install failed (see install.log): the servers need posttrain's vLLM plugin"
$py -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)' \
  2>&1 | tee "$out/env.txt"
gpus=$(nvidia-smi --list-gpus 2>/dev/null | wc -l)
if [ "$gpus" -ge 3 ]; then devices="1;2"; share=""
elif [ "$gpus" -eq 2 ]; then devices="1;1"; share="--gpu-memory-utilization 0.4"
else devices="0;0"; share="--gpu-memory-utilization 0.3"
fi
echo "GPUs: $gpus; servers on: $devices; $share" | tee -a "$out/env.txt"
# posttrain's transport, and with two GPUs or more vLLM's NCCL one too (--rollout_transfer
# nccl: NCCL refuses two ranks on one device; never run on a GPU before this script, so a
# failed run prints its command and its stderr's tail)
transfers=posttrain
if [ "$gpus" -ge 2 ]; then transfers=posttrain,nccl; fi
CUDA_VISIBLE_DEVICES=0 timeout 420 $py benchmarks/rollout_servers.py --sizes medium,large \
  --steps 5 --repeats 1 --servers 1 --transfers "$transfers" --devices "$devices" \
  --server_args "$share" 2>&1 | grep -v "Loading weights" | tee "$out/rollout_servers.log"
