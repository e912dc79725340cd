"""The request schemas of the native routes, for the OpenAPI document."""

from __future__ import annotations

from typing import Any

_INTEGERS = {"type": "array", "items": {"type": "integer", "minimum": 0}}
_TEXT_VALUE = {"oneOf": [{"type": "string"}, {"type": "object"}, {"type": "array"}, {"type": "null"}]}
NATIVE_SCHEMAS: dict[str, Any] = {
    "GenerateRequest": {"type": "object", "properties": {
        "text": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "maxItems": 64}]},
        "input_ids": {"oneOf": [_INTEGERS, {"type": "array", "items": _INTEGERS, "maxItems": 64}]},
        "sampling_params": {"oneOf": [{"type": "object"}, {"type": "array", "items": {"type": "object"}}],
                            "description": "max_new_tokens (default 128), min_new_tokens, temperature, top_p, "
                                           "top_k, min_p, the three penalties, stop, stop_token_ids, ignore_eos, "
                                           "skip_special_tokens, no_stop_trim, seed, logit_bias, and at most one "
                                           "of json_schema, regex, ebnf"},
        "stream": {"type": "boolean"}, "return_logprob": {"type": "boolean"},
        "top_logprobs_num": {"type": "integer", "minimum": 0, "maximum": 20},
        "token_ids_logprob": _INTEGERS, "return_text_in_logprobs": {"type": "boolean"},
        "logprob_start_len": {"const": -1, "description": "Prompt tokens are not scored."},
        "rid": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
        "image_data": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}],
                       "description": "A vision model's images for one text prompt (data URLs, base64 or http(s) "
                                      "URLs); the text writes the image marker once where each goes."}}},
    "TokenizeRequest": {"type": "object", "properties": {
        "model": {"type": "string"}, "prompt": {"type": "string"}, "messages": {"type": "array"},
        "add_special_tokens": {"type": "boolean"}, "add_generation_prompt": {"type": "boolean"},
        "continue_final_message": {"type": "boolean"}, "chat_template_kwargs": {"type": "object"},
        "return_token_strs": {"type": "boolean"}}},
    "DetokenizeRequest": {"type": "object", "required": ["tokens"], "properties": {
        "model": {"type": "string"}, "tokens": _INTEGERS}},
    "SystemOneRequest": {"type": "object", "required": ["state", "questions"], "additionalProperties": False,
                         "properties": {
        "model": {"type": "string"},
        "state": {"oneOf": [{"type": "string"}, {"type": "object"}, {"type": "array"}]},
        "questions": {"type": "object", "minProperties": 1, "maxProperties": 64, "additionalProperties": {
            "type": "object", "required": ["type"], "additionalProperties": False, "properties": {
                "type": {"enum": ["choice", "score", "noul"]}, "instructions": _TEXT_VALUE,
                "criteria": {"description": "choice: an object of 1 to 26 option names to descriptions; score: "
                                            "an array of 1 to 26 levels; noul: optional {true, false}"}}}}}},
}
