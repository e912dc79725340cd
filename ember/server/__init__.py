"""The HTTP server: app factory, middleware, admission, the generation pipeline and `ember serve`.

See README.md in this folder for the routes, the limits and the choices made."""
