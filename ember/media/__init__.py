"""Images in prompts: reading and checking them (image.py), the limits a request's images keep
(limits.py), and each vision architecture's preparation through its own processor config
(processing.py). No torch here: the front end checks and lays out images; the engine worker
prepares their pixels and encodes them (engine.images)."""
