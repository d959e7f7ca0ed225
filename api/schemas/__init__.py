"""Request and response bodies (pydantic v2). Request models forbid unknown fields."""
