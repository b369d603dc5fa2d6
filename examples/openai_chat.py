"""Ask a model served by ``strata serve`` a question, with the official ``openai`` client.

    strata serve                                  # in another terminal
    python examples/openai_chat.py "What is the capital of France?"
"""

import argparse

from openai import OpenAI


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("question", nargs="?", default="What is the capital of France?")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default="none", help="the server's --api-key, if it was started with one")
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()

    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = client.models.list().data[0].id  # the server serves one model
    response = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": args.question}],
        max_tokens=args.max_tokens,
        temperature=0.7,
    )
    print(response.choices[0].message.content)
    print(f"[{response.usage.prompt_tokens} prompt tokens, {response.usage.completion_tokens} completion tokens]")


if __name__ == "__main__":
    main()
