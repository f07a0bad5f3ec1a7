"""Web demo: `python app.py [--checkpoint PATH_OR_URL] [--host H] [--port N]` (see --help).

The same as `captioner demo [...]` from an installed package; the page is `captioner.demo.app`.
"""

from captioner.demo.app import get_args_parser, main

if __name__ == "__main__":
    main(get_args_parser(prog="app.py").parse_args())
