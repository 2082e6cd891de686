"""Serving: AsyncLLM (the engine on a background thread, streamed increments to asyncio) and an
OpenAI-compatible HTTP server on it (FastAPI + uvicorn, Prometheus metrics). See docs/serving.md."""
from pagedattn.serving.async_llm import AsyncLLM, EngineDeadError, EngineStepError, RequestStream

__all__ = ["AsyncLLM", "EngineDeadError", "EngineStepError", "RequestStream"]
