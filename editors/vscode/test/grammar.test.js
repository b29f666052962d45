// `npm test`: the TextMate grammar tokenises every example, every program of the error gallery
// and every stdlib module, line by line, without error and without a rule left open at the end
// of a line (no construct of the language spans lines); sample lines get the expected scopes;
// and every built-in of stdlib/src/builtins.rs is highlighted as one.
'use strict';

const assert = require('node:assert/strict');
const fs = require('node:fs');
const path = require('node:path');
const vsctm = require('vscode-textmate');
const oniguruma = require('vscode-oniguruma');

const repo = path.resolve(__dirname, '..', '..', '..');
const grammarPath = path.join(__dirname, '..', 'syntaxes', 'rlhf.tmLanguage.json');

async function loadGrammar() {
  const wasm = fs.readFileSync(path.join(path.dirname(require.resolve('vscode-oniguruma')), 'onig.wasm'));
  await oniguruma.loadWASM(wasm.buffer.slice(wasm.byteOffset, wasm.byteOffset + wasm.byteLength));
  const registry = new vsctm.Registry({
    onigLib: Promise.resolve({
      createOnigScanner: (patterns) => new oniguruma.OnigScanner(patterns),
      createOnigString: (s) => new oniguruma.OnigString(s),
    }),
    loadGrammar: async (scopeName) =>
      scopeName === 'source.rlhf'
        ? vsctm.parseRawGrammar(fs.readFileSync(grammarPath, 'utf8'), grammarPath)
        : null,
  });
  return registry.loadGrammar('source.rlhf');
}

// Tokens of one line as [text, innermost scope] pairs, checking that they cover the line.
// The state after a line that opens nothing: the root rule alone.
let closed = null;

function tokenize(grammar, line, where) {
  closed = closed || grammar.tokenizeLine('', vsctm.INITIAL).ruleStack;
  const r = grammar.tokenizeLine(line, closed);
  assert.equal(r.stoppedEarly, false, `${where}: tokenising stopped early`);
  assert.ok(r.ruleStack.equals(closed), `${where}: a rule is still open at the end of the line`);
  let at = 0;
  const out = [];
  for (const t of r.tokens) {
    assert.equal(t.startIndex, at, `${where}: tokens leave a gap at ${at}`);
    at = Math.min(t.endIndex, line.length);
    out.push([line.slice(t.startIndex, t.endIndex), t.scopes[t.scopes.length - 1]]);
  }
  assert.ok(at >= line.length, `${where}: tokens end at ${at} of ${line.length}`);
  return out;
}

function files() {
  const dirs = ['examples', 'examples/errors', 'stdlib/std'];
  const out = [];
  for (const d of dirs) {
    for (const f of fs.readdirSync(path.join(repo, d)).sort()) {
      if (f.endsWith('.rlhf')) out.push(path.join(repo, d, f));
    }
  }
  return out;
}

function scopeOf(tokens, text) {
  const t = tokens.find(([s]) => s === text);
  assert.ok(t, `no token ${JSON.stringify(text)} in ${JSON.stringify(tokens)}`);
  return t[1];
}

async function main() {
  const grammar = await loadGrammar();
  const all = files();
  assert.ok(all.length >= 15, `expected the examples, errors and stdlib, found ${all.length} files`);
  let lines = 0;
  for (const file of all) {
    const text = fs.readFileSync(file, 'utf8');
    text.split('\n').forEach((line, i) => {
      tokenize(grammar, line, `${path.relative(repo, file)}:${i + 1}`);
      lines += 1;
    });
  }

  const cases = [
    ['use std::grpo', { use: 'keyword.other.import.rlhf', grpo: 'entity.name.namespace.rlhf' }],
    ['fn vowel_share(s: Sample) -> float {', {
      fn: 'storage.type.function.rlhf',
      vowel_share: 'entity.name.function.rlhf',
      Sample: 'support.type.rlhf',
      '->': 'keyword.operator.arrow.rlhf',
    }],
    ['  count(s.completion, r"[aeiou]") / max(len(s.completion), 1) // share', {
      count: 'support.function.builtin.rlhf',
      r: 'storage.type.string.rlhf',
      '[aeiou]': 'string.regexp.rlhf',
      '1': 'constant.numeric.integer.rlhf',
      '//': 'punctuation.definition.comment.rlhf',
      ' share': 'comment.line.double-slash.rlhf',
    }],
    ['model policy = tiny(layers: 2, hidden: 128) { train: adamw(lr: 3e-4) }', {
      model: 'storage.type.rlhf',
      policy: 'variable.other.definition.rlhf',
      tiny: 'support.function.builtin.rlhf',
      layers: 'variable.parameter.rlhf',
      '3e-4': 'constant.numeric.float.rlhf',
    }],
    ['  param kl: string = "k\\u{33}\\n" where kl != "" && true', {
      where: 'keyword.control.rlhf',
      '\\u{33}': 'constant.character.escape.rlhf',
      '\\n': 'constant.character.escape.rlhf',
      true: 'constant.language.boolean.rlhf',
      '&&': 'keyword.operator.logical.rlhf',
    }],
    ['dataset d = synthetic::letters(count: 1_000, seed: 0.5)', {
      synthetic: 'entity.name.namespace.rlhf',
      letters: 'support.function.builtin.rlhf',
      '1_000': 'constant.numeric.integer.rlhf',
      '0.5': 'constant.numeric.float.rlhf',
    }],
    ['let s = "unterminated', { 'unterminated': 'string.quoted.double.rlhf' }],
  ];
  for (const [line, want] of cases) {
    const tokens = tokenize(grammar, line, JSON.stringify(line));
    for (const [text, scope] of Object.entries(want)) {
      assert.equal(scopeOf(tokens, text), scope, `${JSON.stringify(text)} in ${JSON.stringify(line)}`);
    }
  }

  // Every built-in of the one table is highlighted as a built-in when called.
  const table = fs.readFileSync(path.join(repo, 'stdlib', 'src', 'builtins.rs'), 'utf8');
  const names = [...table.matchAll(/name: "([a-z_:]+)"/g)].map((m) => m[1].split('::').pop());
  assert.ok(names.length > 30, `found only ${names.length} built-ins`);
  for (const name of names) {
    const tokens = tokenize(grammar, `${name}(x)`, name);
    assert.equal(scopeOf(tokens, name), 'support.function.builtin.rlhf', name);
  }

  console.log(`ok: ${all.length} files, ${lines} lines, ${cases.length} sample lines, ${names.length} built-ins`);
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
