using Microsoft.Extensions.Logging;

namespace ExactlyOnce.Telemetry;

/// <summary>
/// Every log message of ExactlyOnce, source-generated. Event ids: 1000–1099 inbox protocol, 1100–1199 MassTransit
/// integration, 1200–1299 store, 1300–1399 outbox, 1400–1499 maintenance, 1500–1599 recorded steps. docs/telemetry.md lists them.
/// </summary>
internal static partial class Log
{
    [LoggerMessage(EventId = 1001, EventName = "InboxDuplicateDiscarded", Level = LogLevel.Warning,
        Message = "Duplicate message {MessageId} discarded for consumer {ConsumerName}: it was already processed")]
    public static partial void DuplicateDiscarded(ILogger logger, Guid messageId, string consumerName);

    [LoggerMessage(EventId = 1002, EventName = "InboxProcessed", Level = LogLevel.Debug,
        Message = "Message {MessageId} processed by consumer {ConsumerName}; claim committed")]
    public static partial void Processed(ILogger logger, Guid messageId, string consumerName);

    [LoggerMessage(EventId = 1003, EventName = "InboxProcessingFailed", Level = LogLevel.Information,
        Message = "Message {MessageId} failed in consumer {ConsumerName}; the transaction was rolled back and the message stays to be retried")]
    public static partial void ProcessingFailed(ILogger logger, Exception exception, Guid messageId, string consumerName);

    [LoggerMessage(EventId = 1004, EventName = "InboxClaimTimedOut", Level = LogLevel.Warning,
        Message = "Message {MessageId} for consumer {ConsumerName} is still being processed by another delivery after {ClaimTimeout}; it will be retried later")]
    public static partial void ClaimTimedOut(ILogger logger, Guid messageId, string consumerName, TimeSpan claimTimeout);

    [LoggerMessage(EventId = 1005, EventName = "InboxBatchFallback", Level = LogLevel.Warning,
        Message = "A batch of {Count} deliveries for consumer {ConsumerName} could not claim its keys in time (a concurrent delivery held one, or a deadlock); each delivery is processed on its own instead")]
    public static partial void BatchFallback(ILogger logger, Exception exception, int count, string consumerName);

    [LoggerMessage(EventId = 1101, EventName = "MessageIdMissing", Level = LogLevel.Error,
        Message = "A {MessageType} message for consumer {ConsumerName} has no message id; it cannot be deduplicated and is faulted to the error queue")]
    public static partial void MessageIdMissing(ILogger logger, string messageType, string consumerName);

    [LoggerMessage(EventId = 1102, EventName = "InboxDeliveryDeferred", Level = LogLevel.Warning,
        Message = "Message {MessageId} for consumer {ConsumerName} re-queued to {InputAddress} with the same message id, to be retried later")]
    public static partial void DeliveryDeferred(ILogger logger, Guid messageId, string consumerName, Uri inputAddress);

    [LoggerMessage(EventId = 1103, EventName = "InboxFilterAttached", Level = LogLevel.Debug,
        Message = "Inbox attached to consumer {ConsumerType} for {MessageType} as {ConsumerName}")]
    public static partial void FilterAttached(ILogger logger, string consumerType, string messageType, string consumerName);

    [LoggerMessage(EventId = 1201, EventName = "InboxSchemaMissing", Level = LogLevel.Error,
        Message = "The inbox table {Table} does not exist. Add modelBuilder.AddExactlyOnceInbox() to your DbContext, then create and apply a migration: dotnet ef migrations add AddExactlyOnceInbox && dotnet ef database update")]
    public static partial void SchemaMissing(ILogger logger, string table);

    [LoggerMessage(EventId = 1301, EventName = "OutboxPublishFailed", Level = LogLevel.Warning,
        Message = "Outbox message {MessageId} (row {Sequence}) failed to publish, attempt {Attempts}; next attempt at {NextAttemptAt:o}")]
    public static partial void PublishFailed(ILogger logger, Exception? exception, Guid messageId, long sequence, int attempts, DateTime nextAttemptAt);

    [LoggerMessage(EventId = 1302, EventName = "OutboxDispatcherFailed", Level = LogLevel.Error,
        Message = "The outbox dispatcher failed (database or broker unavailable?); nothing was marked dispatched, retrying in {Delay}")]
    public static partial void DispatcherFailed(ILogger logger, Exception exception, TimeSpan delay);

    [LoggerMessage(EventId = 1303, EventName = "OutboxListenerFailed", Level = LogLevel.Warning,
        Message = "The outbox commit listener (LISTEN) failed; reconnecting. The dispatcher keeps polling meanwhile")]
    public static partial void ListenerFailed(ILogger logger, Exception exception);

    [LoggerMessage(EventId = 1401, EventName = "CleanupCompleted", Level = LogLevel.Debug,
        Message = "Retention cleanup deleted {InboxRows} processed inbox rows and {OutboxRows} dispatched outbox rows")]
    public static partial void CleanupCompleted(ILogger logger, long inboxRows, long outboxRows);

    [LoggerMessage(EventId = 1402, EventName = "CleanupFailed", Level = LogLevel.Error,
        Message = "Retention cleanup failed (database unavailable?); it runs again in {Interval}")]
    public static partial void CleanupFailed(ILogger logger, Exception exception, TimeSpan interval);

    [LoggerMessage(EventId = 1403, EventName = "StatisticsFailed", Level = LogLevel.Warning,
        Message = "Reading the inbox and outbox statistics failed; the gauges keep their last values")]
    public static partial void StatisticsFailed(ILogger logger, Exception exception);

    [LoggerMessage(EventId = 1501, EventName = "StepReplayed", Level = LogLevel.Debug,
        Message = "Step {StepName} of message {MessageId} for consumer {ConsumerName} completed earlier; its recorded result is returned without calling again")]
    public static partial void StepReplayed(ILogger logger, string stepName, Guid messageId, string consumerName);

    [LoggerMessage(EventId = 1502, EventName = "StepOutcomeUnknown", Level = LogLevel.Warning,
        Message = "Step {StepName} of message {MessageId} for consumer {ConsumerName} was started (attempt {Attempts}, {StartedAt:o}) and never recorded as completed; outcome unknown, policy {Policy}")]
    public static partial void StepOutcomeUnknown(ILogger logger, string stepName, Guid messageId, string consumerName, int attempts, DateTime startedAt, string policy);

    [LoggerMessage(EventId = 1503, EventName = "StepParked", Level = LogLevel.Error,
        Message = "Step {StepName} of message {MessageId} for consumer {ConsumerName} parked: {Reason}")]
    public static partial void StepParked(ILogger logger, string stepName, Guid messageId, string consumerName, string reason);

    [LoggerMessage(EventId = 1504, EventName = "StepCallFailed", Level = LogLevel.Warning,
        Message = "Step {StepName} of message {MessageId} for consumer {ConsumerName} failed; whether the remote service acted is unknown, so the next attempt goes to the step's policy")]
    public static partial void StepCallFailed(ILogger logger, Exception exception, string stepName, Guid messageId, string consumerName);

    [LoggerMessage(EventId = 1505, EventName = "MessageParked", Level = LogLevel.Error,
        Message = "Message {MessageId} for consumer {ConsumerName} moved to {ParkedAddress}: {Reason}")]
    public static partial void MessageParked(ILogger logger, Guid messageId, string consumerName, Uri parkedAddress, string reason);
}
