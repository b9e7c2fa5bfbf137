'use strict';
// tandem.v1's protos loaded at run time with @grpc/proto-loader (no generated code: a field
// added to generation.proto is sent and received without a change here). Field names are
// camelCase (maxTokens, promptText); int64s decode to JS numbers (counts, far below 2^53);
// enums to their names.

const path = require('node:path');
const fs = require('node:fs');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

// The repository's proto/ when the SDK is used from a checkout (clients/node -> ../../proto).
const DEFAULT_PROTO_DIR = path.resolve(__dirname, '..', '..', '..', 'proto');
const GENERATION_PROTO = 'tandem/v1/generation.proto';

const LOAD_OPTIONS = {
  keepCase: false,
  longs: Number,
  enums: String,
  defaults: true,
  oneofs: true,
};

const cache = new Map();   // proto dir -> { Generation, definition }

// protoDir: the folder holding tandem/v1/*.proto (option `protoDir`, else $TANDEM_PROTO_DIR,
// else the checkout's proto/). Throws an Error naming the folder when the file is missing.
function loadGeneration(protoDir) {
  const dir = path.resolve(protoDir || process.env.TANDEM_PROTO_DIR || DEFAULT_PROTO_DIR);
  let loaded = cache.get(dir);
  if (loaded) return loaded;
  if (!fs.existsSync(path.join(dir, GENERATION_PROTO))) {
    throw new Error(`tandem: no ${GENERATION_PROTO} under ${dir} (pass the proto folder as ` +
      "new Client(address, { protoDir }) or set TANDEM_PROTO_DIR)");
  }
  const definition = protoLoader.loadSync(GENERATION_PROTO, { ...LOAD_OPTIONS, includeDirs: [dir] });
  const Generation = grpc.loadPackageDefinition(definition).tandem.v1.Generation;
  loaded = { Generation, definition };
  cache.set(dir, loaded);
  return loaded;
}

// A message type's fields as proto-loader describes them: [{ name (camelCase), label, type }].
function messageFields(definition, typeName) {
  return definition[`tandem.v1.${typeName}`].type.field;
}

module.exports = { loadGeneration, messageFields, DEFAULT_PROTO_DIR };
