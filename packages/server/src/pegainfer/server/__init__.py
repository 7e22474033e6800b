"""pegainfer's OpenAI-compatible HTTP server (starlette + hypercorn + msgspec)."""
