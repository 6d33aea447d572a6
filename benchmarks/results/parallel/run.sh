#!/bin/bash
# Reproduces raw.txt: python -m kvpilot.bench.tensor_parallel over TPxPP sizes (about 20 min on 2 cores).
cd "$(dirname "$0")/../../.."
B=".venv/bin/python -m kvpilot.bench.tensor_parallel"
for rep in 1 2; do
  echo "== decode-heavy run $rep: 8 prompts x 32 tokens, bf16; $(uptime)"
  $B --sizes 1x1 3x1 1x2 1x3 3x2 --num-prompts 8 --max-tokens 32 2>&1 | grep -v -i warn
  echo "-- one rank with 1 thread:"; $B --threads 1 --sizes 1x1 --num-prompts 8 --max-tokens 32 2>&1 | grep -v -i warn | tail -1
  echo "-- PP sizes with micro-batches always cut (KVPILOT_PP_MIN_MICRO_BATCH_TOKENS=1):"
  KVPILOT_PP_MIN_MICRO_BATCH_TOKENS=1 $B --sizes 1x2 1x3 --num-prompts 8 --max-tokens 32 2>&1 | grep -v -i warn | tail -2
done
echo "== prefill-heavy: 16 prompts x 2 tokens; $(uptime)"
$B --sizes 1x1 3x1 1x2 --num-prompts 16 --max-tokens 2 2>&1 | grep -v -i warn
echo "-- PP2 never cut (KVPILOT_PP_MICRO_BATCHES=1):"; $B --micro-batches 1 --sizes 1x2 --num-prompts 16 --max-tokens 2 2>&1 | grep -v -i warn | tail -1
echo "== prefill-heavy extra; $(uptime)"
echo -n "1 thread: "; $B --threads 1 --sizes 1x1 --num-prompts 16 --max-tokens 2 2>&1 | grep -v -i warn | tail -1
echo -n "default:  "; $B --sizes 1x2 --num-prompts 16 --max-tokens 2 2>&1 | grep -v -i warn | tail -1
echo -n "M=1:      "; $B --micro-batches 1 --sizes 1x2 --num-prompts 16 --max-tokens 2 2>&1 | grep -v -i warn | tail -1
echo "done $(uptime)"
