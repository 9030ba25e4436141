"""The OpenAI-compatible HTTP server (FastAPI + uvicorn over AsyncLLM).

Nothing is imported here: `import ember` must not pull in FastAPI. Start with
`ember.entrypoints.openai.api_server.build_app` or `ember serve`.
"""
