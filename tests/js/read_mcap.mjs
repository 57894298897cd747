// Reads MCAP files with Foxglove's own libraries, as Foxglove opens a ros2 recording, and prints JSON
// (tests/test_mcap_foxglove.py compares it with what the Python readers decode from the same files):
//   - @mcap/core's McapIndexedReader: the summary (schemas, channels, statistics, chunk and metadata
//     indexes) from the end of the file, then the messages through the chunk indexes, CRCs checked;
//     its McapStreamReader reads the whole file front to back as well (every record, CRCs checked);
//   - @foxglove/rosmsg's parse(..., {ros2: true}) for every channel's ros2msg schema;
//   - @foxglove/rosmsg2-serialization's MessageReader for every CDR message (no trailing bytes allowed).
// Usage: node read_mcap.mjs FILE...  -> {"files": [...]} on stdout; any rejection: a message on stderr, exit 1.
import { open, readFile } from "node:fs/promises";

import { McapIndexedReader, McapStreamReader } from "@mcap/core";
import { parse } from "@foxglove/rosmsg";
import { MessageReader } from "@foxglove/rosmsg2-serialization";
import zstd from "@foxglove/wasm-zstd";

await zstd.isLoaded;
const decompressHandlers = { zstd: (buffer, size) => zstd.decompress(buffer, Number(size)) };

// JSON of decoded values: typed arrays as arrays, bigints as numbers where exact, else strings.
const plain = (value) => {
  if (typeof value === "bigint") return Number.isSafeInteger(Number(value)) ? Number(value) : String(value);
  if (ArrayBuffer.isView(value)) return Array.from(value, plain);
  if (Array.isArray(value)) return value.map(plain);
  if (value instanceof Map) return Object.fromEntries([...value].map(([k, v]) => [k, plain(v)]));
  if (value && typeof value === "object") {
    return Object.fromEntries(Object.entries(value).map(([k, v]) => [k, plain(v)]));
  }
  return value;
};

async function indexed(path) {
  const handle = await open(path, "r");
  try {
    const readable = {
      size: async () => BigInt((await handle.stat()).size),
      read: async (offset, size) => {
        const buffer = new Uint8Array(Number(size));
        const { bytesRead } = await handle.read(buffer, 0, buffer.length, Number(offset));
        if (bytesRead !== buffer.length) throw new Error(`short read at ${offset}: ${bytesRead} of ${size}`);
        return buffer;
      },
    };
    const reader = await McapIndexedReader.Initialize({ readable, decompressHandlers });
    const readers = new Map(); // channel id -> [MessageReader, parsed definitions]
    const topics = {};
    for (const [id, channel] of reader.channelsById) {
      const schema = reader.schemasById.get(channel.schemaId);
      if (channel.messageEncoding !== "cdr" || schema?.encoding !== "ros2msg") {
        throw new Error(`${channel.topic}: message encoding ${channel.messageEncoding}, schema ${schema?.encoding}`);
      }
      const definitions = parse(new TextDecoder().decode(schema.data), { ros2: true });
      readers.set(id, new MessageReader(definitions));
      topics[channel.topic] = {
        schema: schema.name,
        // the root definition's fields, as Foxglove lists them
        fields: definitions[0].definitions.map((f) => `${f.type}${f.isArray ? "[]" : ""} ${f.name}`),
        types: definitions.slice(1).map((d) => d.name),
        statistics_count: plain(reader.statistics?.channelMessageCounts.get(id)),
        count: 0,
        messages: [],
      };
    }
    for await (const message of reader.readMessages({ validateCrcs: true })) {
      const channel = reader.channelsById.get(message.channelId);
      const decoder = readers.get(message.channelId);
      const decoded = decoder.readMessage(message.data);
      if (decoder.lastReadHadTrailingBytes()) {
        throw new Error(`${channel.topic} message ${message.sequence}: ${message.data.byteLength} bytes, the schema ` +
                        `reads ${decoder.lastReadByteLength()}`);
      }
      const topic = topics[channel.topic];
      topic.count += 1;
      topic.messages.push({ log_time: plain(message.logTime), publish_time: plain(message.publishTime),
                            sequence: message.sequence, data: plain(decoded) });
    }
    const metadata = [];
    for await (const record of reader.readMetadata()) {
      metadata.push({ name: record.name, metadata: plain(record.metadata) });
    }
    return {
      profile: reader.header.profile,
      library: reader.header.library,
      chunks: reader.chunkIndexes.length,
      compression: [...new Set(reader.chunkIndexes.map((c) => c.compression))],
      metadata_indexes: reader.metadataIndexes.map((m) => m.name),
      summary_offsets: [...reader.summaryOffsetsByOpcode.keys()].sort((a, b) => a - b),
      statistics: reader.statistics && { message_count: plain(reader.statistics.messageCount),
                                         channel_count: reader.statistics.channelCount,
                                         schema_count: reader.statistics.schemaCount,
                                         chunk_count: reader.statistics.chunkCount,
                                         metadata_count: reader.statistics.metadataCount,
                                         start_time: plain(reader.statistics.messageStartTime),
                                         end_time: plain(reader.statistics.messageEndTime) },
      metadata,
      topics,
    };
  } finally {
    await handle.close();
  }
}

// Front to back, every record (what Foxglove falls back to for a file without a summary), CRCs checked.
async function streamed(path) {
  const reader = new McapStreamReader({ decompressHandlers, validateCrcs: true });
  reader.append(await readFile(path));
  const ops = {};
  for (let record; (record = reader.nextRecord()); ) ops[record.type] = (ops[record.type] ?? 0) + 1;
  if (!reader.done()) {
    throw new Error(`stream reader: not a complete MCAP file (${reader.bytesRemaining()} bytes left)`);
  }
  return ops;
}

const files = [];
for (const path of process.argv.slice(2)) {
  try {
    files.push({ path, ...(await indexed(path)), records: await streamed(path) });
  } catch (error) {
    process.stderr.write(`${path}: ${error?.stack ?? error}\n`);
    process.exit(1);
  }
}
process.stdout.write(JSON.stringify({ files }) + "\n");
