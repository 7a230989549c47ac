"""A tool the chat tests offer a model: ``WEATHER`` the function (name, description, JSON-schema
parameters), ``WEATHER_TOOL`` it as an OpenAI ``tools`` entry."""

from __future__ import annotations

WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "unit": {"enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
    },
}
WEATHER_TOOL = {"type": "function", "function": WEATHER}
