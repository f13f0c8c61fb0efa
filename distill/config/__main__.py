"""`python -m distill.config > docs/options.md`: the options page, generated from the config's help texts."""

from distill.config.flags import options_markdown

print(options_markdown(), end="")
