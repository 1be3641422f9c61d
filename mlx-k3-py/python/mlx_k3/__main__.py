"""``python -m mlx_k3 <command> ...``: mlx-lm's command line with the drop-in installed.

    python -m mlx_k3 generate --model DIR --prompt "..."     # any mlx_lm subcommand: generate, server,
    python -m mlx_k3 server --model DIR --port 8080          #   chat, perplexity, benchmark, ...
    python -m mlx_k3 tokenizer-json DIR                      # write DIR/tokenizer.json (Kimi tiktoken)
"""

import sys


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "tokenizer-json":
        from .tokenizer import write_tokenizer_json

        if len(sys.argv) != 3:
            raise SystemExit("usage: python -m mlx_k3 tokenizer-json MODEL_DIR")
        print(write_tokenizer_json(sys.argv[2]))
        return
    import mlx_k3  # noqa: F401  (installs the drop-in)
    from mlx_lm import cli

    cli.main()


if __name__ == "__main__":
    main()
