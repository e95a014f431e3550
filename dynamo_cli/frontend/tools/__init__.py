"""Tool calling and reasoning on the OpenAI surface: request types, prompt rendering, output parsers and
the jailed stream that turns model text into `tool_calls` and `reasoning_content`."""
