#!/usr/bin/env bash
# The GPU check of issue #31, ready to run on a machine with an accelerator:
#   tools/gpu_check.sh --device cuda     # the bench's eval section (real workload, landed vs fast
#                                        # sampler, one phase-A step) and a tiny whale run on the GPU,
#                                        # with the HF engine, then with vLLM when it imports
#   tools/gpu_check.sh --device cpu      # the same as a dry run with tiny shapes (CI runs this)
# Prints what it measured (bench's `name: value` lines, the whale runs' wall time and test
# mean@k); any failing step fails the script. Outputs go to a temp dir, removed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
device=cuda
while [ $# -gt 0 ]; do
    case "$1" in
        --device) device="${2:-}"; shift 2 || { echo "gpu_check.sh: --device needs cpu or cuda" >&2; exit 2; } ;;
        *) echo "gpu_check.sh: unknown argument $1 (use --device cpu|cuda)" >&2; exit 2 ;;
    esac
done
case "$device" in
    # the CPU dry run checks that every step runs, at the least work that does: one question, the h0
    # harness only (not the long-context one), 16 new tokens (CI runs it beside the fast tier)
    cuda) questions=64; bench=(--harnesses h0,long --max-tokens 48); max_tokens=32
          tiny=(--budget 64 --prompts-per-step 4 --group 8 --test-limit 16 --test-n 8 --val-limit 8) ;;
    cpu)  questions=1; bench=(--harnesses h0 --max-tokens 16); max_tokens=16
          tiny=(--budget 8 --prompts-per-step 1 --group 4 --test-limit 1 --test-n 2 --val-limit 1) ;;
    *) echo "gpu_check.sh: --device must be cpu or cuda, not '$device'" >&2; exit 2 ;;
esac
export OMP_WAIT_POLICY=PASSIVE
if [ "$device" = cuda ] && ! python3 -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
    echo "gpu_check.sh: --device cuda, but torch sees no CUDA device here (use --device cpu for the dry run)" >&2
    exit 2
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -c "import torch; print('torch', torch.__version__, '| cuda', torch.cuda.is_available(), \
'|', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu')"

echo "== bench: eval section ($questions questions x 8, ${bench[*]}, landed vs fast) on $device"
python3 tools/bench.py --only eval --device "$device" --questions "$questions" "${bench[@]}"

engines=(hf)
if [ "$device" = cuda ] && python3 -c "import vllm" 2>/dev/null; then engines+=(vllm); fi
for e in "${engines[@]}"; do
    echo "== tiny whale run: --engine $e --device $device"
    start=$(date +%s)
    python3 whale.py --domain searchqa --method whale --engine "$e" --device "$device" --out "$tmp/whale-$e" \
        "${tiny[@]}" --candidates 1 --harness-examples 2 --harness-n 1 --val-n 1 --max-tokens "$max_tokens" \
        --schedule fixed-steps:1,1 --train-layers 1 > "$tmp/whale-$e.log" 2>&1 ||
        { tail -20 "$tmp/whale-$e.log"; echo "gpu_check.sh: the whale run with --engine $e failed" >&2; exit 1; }
    echo "whale_${e}_seconds: $(( $(date +%s) - start ))"
    python3 -c "import json, sys; s = json.load(open(sys.argv[1])); \
print('whale_${e}_summary:', {k: v for k, v in s.items() if isinstance(v, (int, float))})" "$tmp/whale-$e/summary.json"
done
if [ "$device" = cuda ] && [ "${#engines[@]}" -eq 1 ]; then echo "vllm: not importable here, its run skipped"; fi
echo "gpu_check.sh: done ($device)"
