using System.Diagnostics;
using System.Diagnostics.Metrics;

namespace ExactlyOnce.Telemetry;

/// <summary>
/// The one <see cref="Meter"/> and one <see cref="ActivitySource"/> of ExactlyOnce, both named <c>ExactlyOnce</c>.
/// Tags are low-cardinality: the consumer name and the outcome, never a message id (that is on spans only).
/// </summary>
internal sealed class ExactlyOnceTelemetry : IDisposable
{
    public const string Name = "ExactlyOnce";
    public const string ConsumerTag = "exactlyonce.consumer.name";
    public const string OutcomeTag = "exactlyonce.inbox.outcome";

    internal static readonly ActivitySource ActivitySource = new(Name);

    private readonly Meter _meter;
    private readonly Counter<long> _processed;
    private readonly Counter<long> _duplicates;
    private readonly Counter<long> _failed;
    private readonly Counter<long> _deferred;
    private readonly Histogram<double> _duration;
    private readonly Histogram<double> _claimWait;
    private readonly Histogram<long> _batchSize;
    private readonly Counter<long> _dispatched;
    private readonly Counter<long> _dispatchFailed;
    private readonly Histogram<double> _publishLatency;

    public const string TableTag = "exactlyonce.table";

    private readonly Counter<long> _cleanupDeleted;

    public const string StepTag = "exactlyonce.step.name";
    public const string StepOutcomeTag = "exactlyonce.step.outcome";
    public const string ActionTag = "exactlyonce.action.name";

    private readonly Counter<long> _steps;
    private readonly Counter<long> _parked;
    private readonly Counter<long> _actionsExecuted;
    private readonly Counter<long> _actionsFailed;

    public ExactlyOnceTelemetry(IMeterFactory meterFactory, Maintenance.StatisticsState statistics, Maintenance.CleanupState cleanup, TimeProvider timeProvider)
    {
        _meter = meterFactory.Create(Name);
        _steps = _meter.CreateCounter<long>("exactlyonce.steps", "{step}",
            "Recorded steps reached, by outcome: executed, replayed (completed earlier: not called again), retried-with-same-key, " +
            "reconciled-done, reconciled-not-done, parked, not-performed, failed (outcome unknown).");
        _parked = _meter.CreateCounter<long>("exactlyonce.inbox.messages.parked", "{message}",
            "Messages set aside because a recorded step's outcome was unknown and its policy is Park; they wait for an operator.");
        _actionsExecuted = _meter.CreateCounter<long>("exactlyonce.actions.executed", "{action}",
            "After-commit actions executed successfully by the dispatcher.");
        _actionsFailed = _meter.CreateCounter<long>("exactlyonce.actions.failed", "{action}",
            "After-commit action executions that failed; retried after a backoff with the same idempotency key.");
        _cleanupDeleted = _meter.CreateCounter<long>("exactlyonce.cleanup.rows.deleted", "{row}",
            "Rows removed by the retention cleanup, per table.");
        _meter.CreateObservableGauge("exactlyonce.inbox.rows", () => statistics.Latest is { } s ? [new Measurement<long>(s.InboxRows)] : Array.Empty<Measurement<long>>(),
            "{row}", "Rows in the inbox table (an estimate on PostgreSQL); growing without bound means the cleanup is not running.");
        _meter.CreateObservableGauge("exactlyonce.outbox.pending", () => statistics.Latest is { } s ? [new Measurement<long>(s.OutboxPending)] : Array.Empty<Measurement<long>>(),
            "{message}", "Outbox messages not yet dispatched.");
        _meter.CreateObservableGauge("exactlyonce.outbox.oldest_pending.age", () => statistics.Latest is { } s
                ? [new Measurement<double>(s.OldestPendingCreatedAtUtc is { } oldest ? Math.Max(0, (timeProvider.GetUtcNow().UtcDateTime - oldest).TotalSeconds) : 0)]
                : Array.Empty<Measurement<double>>(),
            "s", "Age of the oldest outbox message not yet dispatched (0 when none is pending).");
        _meter.CreateObservableGauge("exactlyonce.cleanup.since_last_success", () => cleanup.LastSuccess is { } last
                ? [new Measurement<double>((timeProvider.GetUtcNow() - last).TotalSeconds)]
                : Array.Empty<Measurement<double>>(),
            "s", "Time since the retention cleanup last succeeded in this process.");
        _processed = _meter.CreateCounter<long>("exactlyonce.inbox.messages.processed", "{message}",
            "Messages whose consumer ran and whose effects committed with the inbox claim.");
        _duplicates = _meter.CreateCounter<long>("exactlyonce.inbox.messages.duplicates", "{message}",
            "Deliveries discarded because a committed claim of the same message id and consumer existed.");
        _failed = _meter.CreateCounter<long>("exactlyonce.inbox.messages.failed", "{message}",
            "Deliveries whose consumer or commit failed; rolled back and left to be retried.");
        _deferred = _meter.CreateCounter<long>("exactlyonce.inbox.messages.deferred", "{message}",
            "Deliveries that waited longer than the claim timeout on another delivery of the same key and were retried later.");
        _duration = _meter.CreateHistogram<double>("exactlyonce.inbox.process.duration", "s",
            "Time from the start of the inbox transaction to its commit or rollback.");
        _claimWait = _meter.CreateHistogram<double>("exactlyonce.inbox.claim.duration", "s",
            "Time the claim statement took, including any wait on a concurrent delivery of the same key.");
        _batchSize = _meter.CreateHistogram<long>("exactlyonce.inbox.batch.size", "{message}",
            "Deliveries that shared one inbox transaction (batched mode only).");
        _dispatched = _meter.CreateCounter<long>("exactlyonce.outbox.messages.dispatched", "{message}",
            "Outbox rows published with broker confirmation and marked dispatched.");
        _dispatchFailed = _meter.CreateCounter<long>("exactlyonce.outbox.messages.failed", "{message}",
            "Outbox publish attempts that failed; the row is retried after a backoff.");
        _publishLatency = _meter.CreateHistogram<double>("exactlyonce.outbox.publish.latency", "s",
            "Time from an outbox row's commit to its confirmed publish.");
    }

    public void RecordDispatched(TimeSpan sinceCreated)
    {
        _dispatched.Add(1);
        _publishLatency.Record(Math.Max(0, sinceCreated.TotalSeconds));
    }

    public void RecordDispatchFailed() => _dispatchFailed.Add(1);

    public void RecordCleanupDeleted(string table, int rows)
    {
        if (rows > 0)
        {
            _cleanupDeleted.Add(rows, new KeyValuePair<string, object?>(TableTag, table));
        }
    }

    public void RecordStep(Steps.StepKey step, string outcome) =>
        _steps.Add(1, new KeyValuePair<string, object?>(ConsumerTag, step.Message.ConsumerName),
            new KeyValuePair<string, object?>(StepTag, step.Name), new KeyValuePair<string, object?>(StepOutcomeTag, outcome));

    public void RecordAction(string name, bool succeeded) =>
        (succeeded ? _actionsExecuted : _actionsFailed).Add(1, new KeyValuePair<string, object?>(ActionTag, name));

    public Activity? StartProcessActivity(InboxKey key)
    {
        var activity = ActivitySource.StartActivity("inbox process " + key.ConsumerName, ActivityKind.Internal);
        if (activity is { IsAllDataRequested: true })
        {
            activity.SetTag("messaging.message.id", key.MessageId.ToString());
            activity.SetTag(ConsumerTag, key.ConsumerName);
        }

        return activity;
    }

    public void RecordClaimWait(string consumerName, TimeSpan elapsed) =>
        _claimWait.Record(elapsed.TotalSeconds, new KeyValuePair<string, object?>(ConsumerTag, consumerName));

    public void RecordBatchSize(string consumerName, int size) =>
        _batchSize.Record(size, new KeyValuePair<string, object?>(ConsumerTag, consumerName));

    public void RecordOutcome(string consumerName, InboxOutcome outcome, TimeSpan elapsed, Activity? activity, Activity? consumeActivity = null)
    {
        var consumer = new KeyValuePair<string, object?>(ConsumerTag, consumerName);
        string outcomeName = OutcomeName(outcome);
        switch (outcome)
        {
            case InboxOutcome.Processed: _processed.Add(1, consumer); break;
            case InboxOutcome.Duplicate: _duplicates.Add(1, consumer); break;
            case InboxOutcome.Deferred: _deferred.Add(1, consumer); break;
            case InboxOutcome.Parked: _parked.Add(1, consumer); break;
            default: _failed.Add(1, consumer); break;
        }

        _duration.Record(elapsed.TotalSeconds, consumer, new KeyValuePair<string, object?>(OutcomeTag, outcomeName));
        activity?.SetTag(OutcomeTag, outcomeName);
        consumeActivity?.SetTag(OutcomeTag, outcomeName);
    }

    public static string OutcomeName(InboxOutcome outcome) => outcome switch
    {
        InboxOutcome.Processed => "processed",
        InboxOutcome.Duplicate => "duplicate",
        InboxOutcome.Deferred => "deferred",
        InboxOutcome.Parked => "parked",
        _ => "failed",
    };

    public void Dispose() => _meter.Dispose();
}
