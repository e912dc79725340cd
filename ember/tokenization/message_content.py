"""A chat message's content as the template gets it: a plain string, or, when the message holds an
image, a list of text parts {"type": "text", "text": ...} and image parts {"type": "image",
"image": ...} in order (the image an ImageRef as a dialect read it, an ImageInput once read).

The dialects build contents, and the conversation changes (parsers.tool_prompt, chat_prompt,
protocols.cache_hints) join and cut them, through these functions, so a message keeps the string
form whenever it holds no image. Offsets into a content (cache breakpoints' cuts) count its
text's characters and one unit per image, so a cut falls before or after an image unambiguously.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

Content = Any  # str | list[dict[str, Any]]


def text_part(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def image_part(image: Any) -> dict[str, Any]:
    return {"type": "image", "image": image}


def is_image(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "image"


def build_content(pieces: Iterable[Any]) -> Content:
    """Contents (strings or part lists) and parts in order -> one content: their text joined when
    none holds an image, else the list of parts, adjacent texts joined and empty ones left out."""
    parts: list[dict[str, Any]] = []
    for piece in pieces:
        if isinstance(piece, list):
            parts.extend(_parts(piece))
        elif isinstance(piece, str):
            parts.append(text_part(piece))
        else:
            parts.append(piece)
    if not any(is_image(part) for part in parts):
        return "".join(part["text"] for part in parts)
    joined: list[dict[str, Any]] = []
    for part in parts:
        if is_image(part):
            joined.append(part)
        elif part["text"]:
            if joined and not is_image(joined[-1]):
                joined[-1] = text_part(joined[-1]["text"] + part["text"])
            else:
                joined.append(part)
    return joined


def content_length(content: Content) -> int:
    """Its length in the units cuts count: characters of text, one per image."""
    if content is None or isinstance(content, str):
        return len(content or "")
    return sum(1 if is_image(part) else len(part.get("text", "")) for part in content)


def cut_content(content: Content, cut: int) -> Content:
    """Its first `cut` units (see content_length)."""
    if content is None or isinstance(content, str):
        return (content or "")[:cut]
    kept: list[dict[str, Any]] = []
    left = cut
    for part in content:
        if left <= 0:
            break
        if is_image(part):
            kept.append(part)
            left -= 1
        else:
            kept.append(text_part(part.get("text", "")[:left]))
            left -= len(kept[-1]["text"])
    return build_content(kept)


def _parts(content: list[Any]) -> list[dict[str, Any]]:
    return [part if is_image(part) else text_part(part.get("text", "")) for part in content]
