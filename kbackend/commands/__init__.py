"""One module per ``kbackend`` subcommand; ``kbackend.cli`` discovers them."""
