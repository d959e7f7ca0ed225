"""What the routes call: validation beyond one field, writes, and the one commit per request."""
