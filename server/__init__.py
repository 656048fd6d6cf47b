"""Pagoda HTTP edge: OpenAI protocol, errors, SSE, metrics, CLI."""
