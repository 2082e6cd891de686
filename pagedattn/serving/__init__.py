"""Serving: the engine core (the engine behind ZMQ, on a thread or in processes of its own), CoreClient (its
one front: streamed increments to asyncio) and an OpenAI-compatible HTTP server on it (FastAPI + uvicorn,
Prometheus metrics), started from one ServeConfig. See docs/serving.md."""
from pagedattn.serving.config import ServeConfig, ServerLimits
from pagedattn.serving.core_client import CoreClient
from pagedattn.serving.stream import EngineDeadError, EngineStepError, RequestFailedError, RequestStream

__all__ = ["CoreClient", "ServeConfig", "ServerLimits", "EngineDeadError", "EngineStepError", "RequestFailedError",
           "RequestStream"]
