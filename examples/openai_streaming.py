"""Stream a completion from ``strata serve``, printing the text as it arrives.

    strata serve                                  # in another terminal
    python examples/openai_streaming.py "Once upon a time"
"""

import argparse

from openai import OpenAI


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompt", nargs="?", default="Once upon a time")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default="none", help="the server's --api-key, if it was started with one")
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()

    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = client.models.list().data[0].id  # the server serves one model
    stream = client.completions.create(
        model=model, prompt=args.prompt, max_tokens=args.max_tokens, temperature=0.7, stream=True
    )
    print(args.prompt, end="", flush=True)
    for chunk in stream:
        if chunk.choices:
            print(chunk.choices[0].text, end="", flush=True)
    print()


if __name__ == "__main__":
    main()
