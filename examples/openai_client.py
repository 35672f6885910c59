"""Talk to `kiln serve` (or `make serve`) with the official OpenAI client.

kiln serve --port 8000 &
python examples/openai_client.py --base-url http://127.0.0.1:8000/v1
"""

from __future__ import annotations

import argparse

from openai import OpenAI


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default="unused")
    args = parser.parse_args()
    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = client.models.list().data[0].id

    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Name three colours."}],
        max_tokens=48,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    print("chat:", chat.choices[0].message.content)
    print(
        "first token alternatives:",
        [(t.token, round(t.logprob, 2)) for t in chat.choices[0].logprobs.content[0].top_logprobs],
    )

    print("stream: ", end="")
    stream = client.completions.create(
        model=model,
        prompt="The three primary colours are",
        max_tokens=32,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"top_k": 20, "repetition_penalty": 1.1, "seed": 0},
    )
    for chunk in stream:
        if chunk.choices:
            print(chunk.choices[0].text, end="", flush=True)
        if chunk.usage:
            print(f"\n({chunk.usage.prompt_tokens} prompt + {chunk.usage.completion_tokens} completion tokens)")


if __name__ == "__main__":
    main()
