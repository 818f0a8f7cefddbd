namespace ExactlyOnce;

/// <summary>The deduplication key of the inbox: a message id within the scope of one consumer.</summary>
/// <param name="MessageId">The broker message id, stable across redeliveries.</param>
/// <param name="ConsumerName">The consumer's stable identity.</param>
public readonly record struct InboxKey(Guid MessageId, string ConsumerName);
