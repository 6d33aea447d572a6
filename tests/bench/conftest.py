"""SmolLM2's tokenizer and the SSE test peer (tests/load_peer.py, on sys.path through tests/conftest.py)."""

from load_peer import smollm2_tokenizer, sse_peer  # noqa: F401  (session fixtures)
