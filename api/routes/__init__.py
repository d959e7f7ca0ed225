"""One router per resource; each route is wiring only (parse, call a service or query, shape)."""
