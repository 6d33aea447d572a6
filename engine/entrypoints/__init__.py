"""The OpenAI-compatible HTTP server (`kvpilot serve`): FastAPI routes over an engine
loop running in a background thread, with vLLM's Prometheus metrics."""
