"""The router's HTTP face: the service, the apps and hot path, the OpenAI relay, status,
metrics and the API schema."""
