"""`kvpilot serve` with a fault injected into the step the whole batch shares: once a
request asking for exactly FAULT_MAX_TOKENS tokens is in the engine, the model step raises,
as a kernel or device fault would. Run as `python faulty_serve.py [serve flags]`."""

from __future__ import annotations

import sys

from kvpilot.engine.entrypoints.serve import main
from kvpilot.engine.engine.llm_engine import LLMEngine

FAULT_MAX_TOKENS = 13
_step = LLMEngine.step


def _faulty_step(self: LLMEngine):
    queued = [*self.scheduler.waiting, *self.scheduler.running]
    if any(seq.sampling_params.max_tokens == FAULT_MAX_TOKENS for seq in queued):
        raise RuntimeError("injected fault in the shared model step")
    return _step(self)


if __name__ == "__main__":
    LLMEngine.step = _faulty_step
    sys.exit(main(sys.argv[1:]))
