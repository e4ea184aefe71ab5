"""The OpenAI-compatible API: request and response models (``protocol``) and
pure translations to and from the engine's ``GenerateReqInput`` and outputs
(``adapters``). The HTTP routes that use them live in the HTTP server."""
