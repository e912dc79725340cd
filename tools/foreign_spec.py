"""Derive the foreign OpenAPI spec ember's fuzz test runs (tests/e2e/specs/foreign_openapi.json)
from another server's OpenAPI document: only the routes ember also serves, and only their
structure (methods, parameters, request body schemas, response codes). Every description, summary,
example and title is left out, and so are response bodies, tags and servers: the file holds facts
about the other server's interface, none of its prose.

    python tools/foreign_spec.py OTHER_OPENAPI.json [tests/e2e/specs/foreign_openapi.json]

A route is shared when ember has one with the same path (parameter names aside) and method; HEAD
counts where ember serves GET, since ember answers HEAD on every path. The schemas kept are those
the kept operations reference, directly or through other schemas. Run it again when either side
changes; the output is sorted, so a diff shows what moved.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

DEFAULT_OUTPUT = Path(__file__).resolve().parent.parent / "tests" / "e2e" / "specs" / "foreign_openapi.json"
PROSE = {"description", "summary", "example", "examples", "title", "externalDocs", "x-examples"}
NAME_MAPS = {"properties", "patternProperties", "$defs", "definitions"}  # their keys are names, not keywords
METHODS = {"get", "put", "post", "delete", "options", "head", "patch", "trace"}
KEPT_OPERATION_KEYS = ("operationId", "parameters", "requestBody")


def ember_routes() -> set[tuple[str, str]]:
    """(path shape, method) of every route ember's app serves; no model is loaded."""
    from ember.server.app import create_app
    from ember.server.config import ServerConfig

    routes = set()
    for route in create_app(ServerConfig()).routes:
        for method in getattr(route, "methods", None) or ():
            routes.add((path_shape(route.path), method.lower()))
    routes |= {(path, "head") for path, method in list(routes) if method == "get"}
    return routes


def path_shape(path: str) -> str:
    """A path with its parameters unnamed: /v1/models/{model_id:path} and /v1/models/{model} agree."""
    return re.sub(r"\{[^}]*\}", "{}", path)


def without_prose(value: Any, names: bool = False) -> Any:
    """`value` with every prose keyword removed, at any depth; keys of a name map (`properties`)
    are field names and stay, whatever they are called."""
    if isinstance(value, dict):
        return {key: without_prose(item, names=key in NAME_MAPS and not names)
                for key, item in value.items() if names or key not in PROSE}
    if isinstance(value, list):
        return [without_prose(item) for item in value]
    return value


def references(value: Any) -> set[str]:
    found = set()
    if isinstance(value, dict):
        ref = value.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/components/schemas/"):
            found.add(ref.rsplit("/", 1)[1])
        for item in value.values():
            found |= references(item)
    elif isinstance(value, list):
        for item in value:
            found |= references(item)
    return found


def derive(document: dict[str, Any], shared: set[tuple[str, str]]) -> dict[str, Any]:
    paths: dict[str, Any] = {}
    for path, operations in sorted(document.get("paths", {}).items()):
        kept = {}
        for method, operation in sorted(operations.items()):
            if method not in METHODS or (path_shape(path), method) not in shared:
                continue
            entry = {key: without_prose(operation[key]) for key in KEPT_OPERATION_KEYS if key in operation}
            entry["responses"] = {code: {"description": ""} for code in sorted(operation.get("responses", {}))}
            kept[method] = entry
        if kept:
            paths[path] = kept
    schemas = document.get("components", {}).get("schemas", {})
    needed, todo = set(), references(paths)
    while todo:
        name = todo.pop()
        if name in needed or name not in schemas:
            continue
        needed.add(name)
        todo |= references(schemas[name])
    return {
        "openapi": document.get("openapi", "3.1.0"),
        "info": {"title": "foreign", "version": str(document.get("info", {}).get("version", "0"))},
        "paths": paths,
        "components": {"schemas": {name: without_prose(schemas[name]) for name in sorted(needed)}},
    }


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3):
        print("usage: python tools/foreign_spec.py OTHER_OPENAPI.json [OUTPUT.json]", file=sys.stderr)
        return 2
    document = json.loads(Path(argv[1]).read_text(encoding="utf-8"))
    output = Path(argv[2]) if len(argv) == 3 else DEFAULT_OUTPUT
    spec = derive(document, ember_routes())
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(spec, indent=1, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")
    operations = sum(len(ops) for ops in spec["paths"].values())
    print(f"{output}: {operations} operations on {len(spec['paths'])} paths, {len(spec['components']['schemas'])} "
          f"schemas")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
