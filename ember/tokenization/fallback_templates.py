"""Chat templates for GGUF files that carry none, by architecture.

Gemma 3: turns open with <start_of_turn> and the role ("model" for the assistant) on its own line,
and close with <end_of_turn>; a system message has no turn of its own, it opens the first user
turn followed by a blank line. Images are not rendered: a Gemma 3 GGUF is served as text (ember
reads no gemma3 mmproj yet).
"""

GEMMA3 = (
    "{{ bos_token }}"
    "{%- set system = messages[0]['content'] if messages and messages[0]['role'] == 'system' else none -%}"
    "{%- for message in messages if message['role'] != 'system' -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' ~ role ~ '\n' }}"
    "{%- if loop.first and system is not none -%}{{ system ~ '\n\n' }}{%- endif -%}"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
    "{%- else -%}{%- for part in message['content'] if part['type'] == 'text' -%}{{ part['text'] | trim }}"
    "{%- endfor -%}{%- endif -%}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)

BY_GGUF_ARCHITECTURE = {"gemma3": GEMMA3}
