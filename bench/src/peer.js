// The `peer` mode of the bench (inboxctl-bench): pg-transactional-outbox's transactional inbox, set up as its README
// and its RabbitMQ example (examples/rabbitmq/consumer) do, consuming the same queue and making the same effect (one
// row in carrier_reservations) as inboxctl's modes.
//
//   node peer.js setup     creates the library's inbox table and polling function (DatabaseSetupExporter's polling
//                          script, without roles: the bench's user is the listener and the handler role)
//   node peer.js consume   consumes QUEUE until SIGTERM, or until idle for EXIT_WHEN_IDLE_MS
//
// Environment: DATABASE_URL, AMQP_URL, QUEUE, CONCURRENCY (the polling batch size: messages handled at once),
// PREFETCH, EXIT_WHEN_IDLE_MS. Exit code 0 when stopped or idle, 1 on any error (written to stderr).
//
// As in the library's example: the receiver stores each message in the inbox in a transaction of its own, one at a
// time (a mutex keeps the insert order), and acks once it is stored; the handler runs later, from the polling
// listener, in a transaction that also marks the inbox row processed. The ack comes before the handler has run.
'use strict';

const crypto = require('node:crypto');
const amqp = require('amqplib');
const { Mutex } = require('async-mutex');
const { Pool } = require('pg');
const {
  DatabaseSetupExporter,
  IsolationLevel,
  executeTransaction,
  getDefaultLogger,
  initializeMessageStorage,
  initializePollingMessageListener,
} = require('pg-transactional-outbox');

const TABLE = 'inbox';
const NEXT_MESSAGES = 'next_inbox_messages';

function env(name, fallback) {
  const value = process.env[name];
  if (value === undefined || value === '') {
    if (fallback !== undefined) return fallback;
    throw new Error(`${name} is not set`);
  }
  return value;
}

async function setup() {
  const pool = new Pool({ connectionString: env('DATABASE_URL'), max: 1 });
  try {
    const { rows } = await pool.query('SELECT current_database() AS db, current_user AS role');
    const script = DatabaseSetupExporter.createPollingScript(
      {
        outboxOrInbox: 'inbox',
        database: rows[0].db,
        schema: 'public',
        table: TABLE,
        listenerRole: rows[0].role,
        handlerRole: rows[0].role,
        nextMessagesName: NEXT_MESSAGES,
      },
      true,
    );
    await pool.query(script);
  } finally {
    await pool.end();
  }
}

// A MassTransit envelope as the library's message: the envelope's messageId is the inbox id (a UUID, as the library
// requires), the event its payload; 'parallel', as the example sets on every received message.
function toTransactionalMessage(body) {
  const envelope = JSON.parse(body.toString('utf8'));
  const event = envelope.message || {};
  if (!envelope.messageId || !event.parcelId) return undefined;
  return {
    id: envelope.messageId,
    aggregateType: 'parcel',
    aggregateId: String(event.parcelId),
    messageType: 'parcel_created',
    payload: event,
    concurrency: 'parallel',
    createdAt: new Date().toISOString(),
  };
}

async function consume() {
  const databaseUrl = env('DATABASE_URL');
  const queue = env('QUEUE');
  const concurrency = Number(env('CONCURRENCY', '16'));
  const prefetch = Number(env('PREFETCH', '64'));
  const idleMs = Number(env('EXIT_WHEN_IDLE_MS', '0'));

  const logger = getDefaultLogger('peer');
  logger.level = 'error';
  const config = {
    outboxOrInbox: 'inbox',
    dbListenerConfig: { connectionString: databaseUrl },
    settings: {
      dbSchema: 'public',
      dbTable: TABLE,
      // The README's advice for the inbox: both protections on.
      enableMaxAttemptsProtection: true,
      enablePoisonousMessageProtection: true,
      nextMessagesFunctionName: NEXT_MESSAGES,
      // Messages handled at once, as every other mode's --concurrency. Polling interval and lock: the defaults.
      nextMessagesBatchSize: concurrency,
    },
  };

  let lastActivity = Date.now();
  let failed;
  const fail = (err) => {
    if (!failed) failed = err;
  };

  const handler = {
    aggregateType: 'parcel',
    messageType: 'parcel_created',
    handle: async (message, client) => {
      await client.query(
        'INSERT INTO carrier_reservations (parcel_id, slot_id, pickup_at, message_id, idempotency_key) ' +
          "VALUES ($1, $2, date_trunc('day', now()) + interval '1 day 9 hours', $3, $4)",
        [message.payload.parcelId, crypto.randomUUID(), message.id, crypto.randomUUID()],
      );
      lastActivity = Date.now();
    },
  };
  const [stopListener] = initializePollingMessageListener(config, [handler], logger);

  const storeInboxMessage = initializeMessageStorage(config, logger);
  const pool = new Pool({ connectionString: databaseUrl });
  pool.on('error', fail);
  const connection = await amqp.connect(env('AMQP_URL'));
  connection.on('error', fail);
  const channel = await connection.createChannel();
  channel.on('error', fail);
  await channel.prefetch(prefetch);
  const mutex = new Mutex();
  await channel.consume(queue, async (delivery) => {
    if (!delivery) return;
    lastActivity = Date.now();
    let message;
    try {
      message = toTransactionalMessage(delivery.content);
    } catch (err) {
      message = undefined;
    }
    if (!message) {
      // The example acks (skips) what is not a message it understands; the bench sends none.
      channel.ack(delivery);
      return;
    }
    const release = await mutex.acquire();
    try {
      await executeTransaction(
        await pool.connect(),
        async (client) => storeInboxMessage(message, client),
        IsolationLevel.ReadCommitted,
      );
      channel.ack(delivery);
    } catch (err) {
      channel.nack(delivery, false, true);
      fail(err);
    } finally {
      release();
    }
  });

  let stopping = false;
  const stop = async (code) => {
    if (stopping) return;
    stopping = true;
    clearInterval(timer);
    try {
      await channel.close();
    } catch (_) {
      // already closed
    }
    try {
      await connection.close();
    } catch (_) {
      // already closed
    }
    await stopListener();
    await pool.end();
    if (failed) console.error(`peer: ${failed.stack || failed}`);
    process.exit(failed ? 1 : code);
  };
  process.on('SIGTERM', () => void stop(0));
  process.on('SIGINT', () => void stop(0));

  const timer = setInterval(async () => {
    if (failed) return void stop(1);
    if (!idleMs || Date.now() - lastActivity < idleMs) return;
    try {
      const { messageCount } = await channel.checkQueue(queue);
      const { rows } = await pool.query(
        `SELECT count(*)::int AS n FROM public.${TABLE} WHERE processed_at IS NULL AND abandoned_at IS NULL`,
      );
      if (messageCount === 0 && rows[0].n === 0 && Date.now() - lastActivity >= idleMs) {
        void stop(0);
      }
    } catch (err) {
      fail(err);
    }
  }, 200);
}

const command = process.argv[2];
const run = command === 'setup' ? setup : command === 'consume' ? consume : undefined;
if (!run) {
  console.error('usage: node peer.js setup|consume');
  process.exit(64);
}
run().catch((err) => {
  console.error(`peer: ${err.stack || err}`);
  process.exit(1);
});
