"""Serving: continuous batching with lossless speculative decoding, load-aware speculation, and
an OpenAI-compatible HTTP server (the server needs the ``serve`` extra: fastapi, uvicorn,
prometheus_client)."""

from .policy import AcceptanceMonitor, SpeculationPolicy, parse_table
from .scheduler import Event, QueueFull, Request, RequestHandle, ServingEngine
from .slots import SlotCache, forward_slots

__all__ = ["AcceptanceMonitor", "Event", "QueueFull", "Request", "RequestHandle", "ServingEngine", "SlotCache",
           "SpeculationPolicy", "forward_slots", "parse_table"]
