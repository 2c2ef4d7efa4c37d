"""The OpenAI-compatible HTTP server (vLLM twin: ``vllm/entrypoints/openai/``).

Layout as in vLLM: ``api_server.py`` builds the FastAPI app around one
``AsyncLLM``; ``engine/`` holds the shared protocol types and the
``OpenAIServing`` base; ``completion/`` and ``chat_completion/`` the two
generation endpoints; ``models/`` the model list. Sessions: 01.
"""
