"""python -m pagedattn [demo options]   the demo (pagedattn.demo)
python -m pagedattn serve [options]    the OpenAI-compatible HTTP server (pagedattn.serving.cli)
"""
import sys


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "serve":
        from pagedattn.serving.cli import main as serve
        return serve(argv[1:])
    from pagedattn.demo import cli
    return cli(argv)


if __name__ == "__main__":
    sys.exit(main())
