"""`bench throughput --skip-hf` with the decode attention of large steps on torch's threads
(default) or, with NOSPLIT=1, on the calling thread only (README section 11).

usage: NOSPLIT=1 attention_threads.py --num-prompts 32 --skip-hf --output-json out.json
"""
import os, sys
from kvpilot.engine.attention import cpu_decode
if os.environ.get("NOSPLIT"):
    cpu_decode.PARALLEL_MIN_WORK = 10**12
from kvpilot.bench import throughput
sys.exit(throughput.main(sys.argv[1:]))
