// The VS Code client of the Braid language server: it starts `braid lsp` (the executable named
// by the `braid.server.path` setting) on stdio for every `.rlhf` file. All language features live
// in the server; this file only connects the two.
'use strict';

const vscode = require('vscode');
const { LanguageClient } = require('vscode-languageclient/node');

let client;

function activate(context) {
  const command = vscode.workspace.getConfiguration('braid').get('server.path') || 'braid';
  const run = { command, args: ['lsp'] };
  const serverOptions = { run, debug: run };
  const clientOptions = {
    documentSelector: [
      { scheme: 'file', language: 'rlhf' },
      { scheme: 'untitled', language: 'rlhf' },
    ],
  };
  client = new LanguageClient('braid', 'Braid language server', serverOptions, clientOptions);
  context.subscriptions.push(client);
  return client.start();
}

function deactivate() {
  return client ? client.stop() : undefined;
}

module.exports = { activate, deactivate };
