"""Chat templates in the form of five model families' own, for tool-call tests: how each hands the
model its tools, writes a past call and a tool's result, and teaches the form of a call.
Written for these tests after the families' published templates (trimmed to what tools touch)."""

# Qwen 2.5 / Qwen 3 (Hermes form): tools in the system turn, calls in <tool_call> tags,
# results in a user turn's <tool_response> tags.
QWEN = """{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content }}{%- else %}{{- 'You are Qwen, a helpful assistant.' }}{%- endif %}
{{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) or (message.role == 'assistant' and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '\\n<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' + (tool_call.arguments | tojson) + '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""

# SmolLM3: tools listed in the system turn's "Tool Calling" section, the Hermes form.
SMOLLM3 = """{%- set system = messages[0].content if messages[0].role == 'system' else '' -%}
<|im_start|>system
## Metadata

Reasoning Mode: /no_think

## Custom Instructions

{{ system }}
{%- if tools %}

### Tools

You may call one or more functions to assist with the user query.
You are provided with function signatures within <tools></tools> XML tags:

<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call>
{%- endif %}<|im_end|>
{% for message in messages -%}
{%- if message.role == 'user' -%}
<|im_start|>user
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' -%}
<|im_start|>assistant
{{ message.content }}
{%- for call in message.tool_calls or [] %}<tool_call>
{{ {"name": call.function.name, "arguments": call.function.arguments} | tojson }}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == 'tool' -%}
<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|im_start|>assistant
{% endif -%}"""

# Llama 3.1 / 3.2: tools in the first user turn as JSON, a call is the bare JSON object with
# "parameters"; results come back in an "ipython" turn.
LLAMA3 = """{{- bos_token }}
{%- if messages[0].role == 'system' %}{%- set system_message = messages[0].content %}{%- set messages = messages[1:] %}{%- else %}{%- set system_message = '' %}{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}
{%- if tools %}{{- 'Environment: ipython\\n' }}{%- endif %}
{{- 'Cutting Knowledge Date: December 2023\\n\\n' + system_message + '<|eot_id|>' }}
{%- if tools and messages %}
{%- set first_user_message = messages[0].content %}{%- set messages = messages[1:] %}
{{- '<|start_header_id|>user<|end_header_id|>\\n\\n' }}
{{- 'Given the following functions, please respond with a JSON for a function call with its proper arguments that best answers the given prompt.\\n\\n' }}
{{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}. Do not use variables.\\n\\n' }}
{%- for t in tools %}{{- t | tojson(indent=4) }}{{- '\\n\\n' }}{%- endfor %}
{{- first_user_message + '<|eot_id|>' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role in ['user', 'assistant'] and not message.tool_calls %}
{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content | trim + '<|eot_id|>' }}
{%- elif message.tool_calls %}
{%- set tool_call = message.tool_calls[0].function %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{{- '{"name": "' + tool_call.name + '", "parameters": ' + (tool_call.arguments | tojson) + '}<|eot_id|>' }}
{%- elif message.role == 'tool' or message.role == 'ipython' %}
{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"""

# Phi-4-mini as vLLM's template teaches it: a list of calls after a "functools" marker.
PHI4_MINI = """{%- if messages[0].role == 'system' %}{%- set system_message = messages[0].content %}{%- set messages = messages[1:] %}{%- else %}{%- set system_message = 'You are a helpful assistant.' %}{%- endif %}
<|system|>
{{ system_message }}
{%- if tools %}
If you decide to call functions, prefix the calls with the functools marker and write them as one JSON list: functools[{"name": [function name], "arguments": [function arguments as JSON]}, ...]
{% for t in tools %}{{ t | tojson(indent=4) }}

{% endfor %}
{%- endif %}<|end|>
{%- for message in messages %}
<|{{ message.role }}|>
{%- if message.content %}
{{ message.content }}
{%- elif message.tool_calls %}
functools[{% for call in message.tool_calls %}{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}{% if not loop.last %}, {% endif %}{% endfor %}]
{%- endif %}<|end|>
{%- endfor %}<|assistant|>
"""

# Gemma 3: takes no tools; a system message goes into the first user turn, and roles must
# alternate user / assistant.
GEMMA3 = """{{ bos_token }}
{%- if messages[0].role == 'system' -%}{%- set first_user_prefix = messages[0].content + '\\n\\n' -%}{%- set loop_messages = messages[1:] -%}
{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}
{%- for message in loop_messages -%}
{%- if (message.role == 'user') != (loop.index0 % 2 == 0) -%}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif -%}
{%- set role = 'model' if message.role == 'assistant' else message.role -%}
{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') + message.content | trim + '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"""

FAMILIES = {"qwen": QWEN, "smollm3": SMOLLM3, "llama3": LLAMA3, "phi4-mini": PHI4_MINI, "gemma3": GEMMA3}
