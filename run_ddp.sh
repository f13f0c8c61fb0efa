#!/usr/bin/env bash
# Distill on NUM_GPUS processes: ./run_ddp.sh NUM_GPUS USE_PROJECTION [more distill flags]
#   ./run_ddp.sh 8 True      8 GPUs, projection mode
#   ./run_ddp.sh 8 False     8 GPUs, Matryoshka (MRL) mode
# Without CUDA it runs NUM_GPUS CPU processes over gloo: that checks the distributed path, it is no faster.
set -euo pipefail

usage() {
    echo "usage: $0 NUM_GPUS USE_PROJECTION [distill flags...], e.g. $0 8 True (USE_PROJECTION: True or False)" >&2
    exit 2
}
[[ $# -ge 2 ]] || usage
num_gpus="$1"
use_projection="$2"
shift 2
if ! [[ "$num_gpus" =~ ^[1-9][0-9]*$ ]]; then
    echo "error: NUM_GPUS must be a positive integer, got '$num_gpus'" >&2
    usage
fi
case "$use_projection" in
    True | true | 1) use_projection=True ;;
    False | false | 0) use_projection=False ;;
    *)
        echo "error: USE_PROJECTION must be True or False, got '$use_projection'" >&2
        usage
        ;;
esac

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
python="${PYTHON:-}"
if [[ -z "$python" ]]; then
    if [[ -x "$here/.venv/bin/python" ]]; then python="$here/.venv/bin/python"; else python="python3"; fi
fi

# the number of CUDA GPUs and the lowest compute capability among them (major version; 0 without GPUs)
cuda="$("$python" -c 'import torch
n = torch.cuda.device_count()
print(n, min((torch.cuda.get_device_capability(i)[0] for i in range(n)), default=0))')"
read -r gpus capability <<<"$cuda"
launch=(-m distill.launch)  # checks the inputs, then accelerate launch; a bad input ends on one error line
if [[ -n "${ACCELERATE_CONFIG:-}" ]]; then  # optional topology file, e.g. accelerate_configs/multi_gpu.yaml
    if [[ ! -f "$ACCELERATE_CONFIG" ]]; then
        echo "error: ACCELERATE_CONFIG '$ACCELERATE_CONFIG' does not exist; pass one of accelerate_configs/*.yaml" >&2
        exit 2
    fi
    machines="$("$python" -c 'import sys; from distill.distributed import config_file_topology
print(config_file_topology(sys.argv[1])[0])' "$ACCELERATE_CONFIG")"
    if ((machines > 1)); then
        echo "error: ACCELERATE_CONFIG '$ACCELERATE_CONFIG' names $machines machines, but run_ddp.sh runs NUM_GPUS" \
            "processes on this machine; on each machine run: accelerate launch --config_file $ACCELERATE_CONFIG" \
            "--machine_rank R -m distill.train [flags] (README: Using it)" >&2
        exit 2
    fi
    launch+=(--config_file "$ACCELERATE_CONFIG")
fi
launch+=(--num_machines 1 --num_processes "$num_gpus")
# a free port, so two runs on this machine do not collide on 29500 (a config file's own port holds)
if [[ -z "${ACCELERATE_CONFIG:-}" ]]; then launch+=(--main_process_port 0); fi
if ((gpus > 0)); then
    if ((num_gpus > gpus)); then
        echo "error: asked for $num_gpus GPUs but $gpus are visible; pass at most $gpus or set CUDA_VISIBLE_DEVICES" >&2
        exit 2
    fi
    if [[ -n "${ACCELERATE_CONFIG:-}" ]]; then
        : # the file's mixed_precision holds (a --mixed_precision flag to distill overrides it)
    elif ((capability >= 8)); then
        launch+=(--mixed_precision bf16)
    else  # bf16 runs emulated, several times slower, before Ampere (compute capability 8.0): T4, V100
        echo "note: GPU compute capability $capability.x has no native bf16: training in fp16 mixed precision" \
            "(pass --mixed_precision bf16 or no to choose otherwise)" >&2
        launch+=(--mixed_precision fp16)
    fi
else
    echo "note: no CUDA GPU found: running $num_gpus CPU process(es) over gloo; this brings no speed-up" >&2
    export ACCELERATE_USE_CPU=true
    # tcmalloc when installed: a flat peak memory on CPU (distill/allocator.py; DISTILL_ALLOCATOR=glibc to opt out)
    preload="$("$python" -m distill.allocator)"
    export LD_PRELOAD="$preload"
fi
if ((num_gpus > 1)); then launch+=(--multi_gpu); fi

exec "$python" "${launch[@]}" -m distill.train --use_projection "$use_projection" "$@"
