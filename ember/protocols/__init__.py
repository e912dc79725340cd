"""API dialects: each validates its JSON into the neutral request (neutral.py) and renders
neutral results back in its own shape. No torch here, and nothing from ember.server."""
