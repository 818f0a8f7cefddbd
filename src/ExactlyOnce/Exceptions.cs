namespace ExactlyOnce;

/// <summary>
/// Another delivery of the same (message id, consumer) held its claim longer than
/// <see cref="ExactlyOnceOptions.ClaimTimeout"/>. The delivery was not processed and must be retried later.
/// </summary>
public sealed class InboxClaimTimeoutException : Exception
{
    /// <summary>Creates the exception.</summary>
    public InboxClaimTimeoutException() : base("The inbox claim timed out.") { }

    /// <summary>Creates the exception with a message.</summary>
    public InboxClaimTimeoutException(string message) : base(message) { }

    /// <summary>Creates the exception with a message and the store's own error.</summary>
    public InboxClaimTimeoutException(string message, Exception innerException) : base(message, innerException) { }
}

/// <summary>A delivered message has no message id, so the inbox cannot deduplicate it. It is faulted, never acknowledged silently.</summary>
public sealed class MessageIdMissingException : Exception
{
    /// <summary>Creates the exception.</summary>
    public MessageIdMissingException() : base("The message has no message id.") { }

    /// <summary>Creates the exception with a message.</summary>
    public MessageIdMissingException(string message) : base(message) { }

    /// <summary>Creates the exception with a message and an inner exception.</summary>
    public MessageIdMissingException(string message, Exception innerException) : base(message, innerException) { }
}

/// <summary>The inbox table does not exist in the database: the migration that adds it has not been applied.</summary>
public sealed class InboxSchemaMissingException : Exception
{
    /// <summary>Creates the exception.</summary>
    public InboxSchemaMissingException() : base("The inbox table does not exist.") { }

    /// <summary>Creates the exception with a message.</summary>
    public InboxSchemaMissingException(string message) : base(message) { }

    /// <summary>Creates the exception with a message and the store's own error.</summary>
    public InboxSchemaMissingException(string message, Exception innerException) : base(message, innerException) { }
}
