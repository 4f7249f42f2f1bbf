"""HTTP layer: FastAPI app, routers per resource, request/response schemas."""
