"""The OpenAI-compatible HTTP server: `create_app(async_engine, server_config)` (see app.py)."""
