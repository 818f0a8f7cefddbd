using ExactlyOnce;
using ExactlyOnce.EntityFrameworkCore;

namespace Microsoft.EntityFrameworkCore;

/// <summary>Adds the ExactlyOnce tables to your own <see cref="DbContext"/> model, so they commit with your data.</summary>
public static class ExactlyOnceModelBuilderExtensions
{
    /// <summary>The inbox table's name.</summary>
    public const string InboxTableName = "inbox_messages";

    /// <summary>The outbox table's name.</summary>
    public const string OutboxTableName = "outbox_messages";

    /// <summary>The recorded steps table's name.</summary>
    public const string RecordedStepsTableName = "recorded_steps";

    /// <summary>Adds the inbox, the outbox (which also holds after-commit actions) and the recorded steps tables.</summary>
    public static ModelBuilder AddExactlyOnce(this ModelBuilder modelBuilder, string? schema = null) =>
        modelBuilder.AddExactlyOnceInbox(schema).AddExactlyOnceOutbox(schema).AddExactlyOnceRecordedSteps(schema);

    /// <summary>
    /// Maps <c>recorded_steps</c>: primary key <c>pk_recorded_steps (message_id, consumer_type, step_name)</c>,
    /// <c>idempotency_key uuid</c>, <c>status</c> (Started, Completed, NotDone, Parked), <c>result</c> (JSON),
    /// <c>attempts</c>, <c>started_at</c>, <c>completed_at</c>, <c>reason</c>; index <c>ix_recorded_steps_started_at</c>
    /// for the retention cleanup. Its rows are written outside the consumer's transaction, on their own connection.
    /// Then add a migration (<c>dotnet ef migrations add AddExactlyOnceRecordedSteps</c>).
    /// </summary>
    public static ModelBuilder AddExactlyOnceRecordedSteps(this ModelBuilder modelBuilder, string? schema = null)
    {
        ArgumentNullException.ThrowIfNull(modelBuilder);
        modelBuilder.Entity<RecordedStep>(entity =>
        {
            entity.ToTable(RecordedStepsTableName, schema);
            entity.HasKey(e => new { e.MessageId, e.ConsumerType, e.StepName }).HasName("pk_recorded_steps");
            entity.Property(e => e.MessageId).HasColumnName("message_id").ValueGeneratedNever();
            entity.Property(e => e.ConsumerType).HasColumnName("consumer_type").HasMaxLength(ExactlyOnceOptions.MaxConsumerNameLength).IsRequired();
            entity.Property(e => e.StepName).HasColumnName("step_name").HasMaxLength(200).IsRequired();
            entity.Property(e => e.IdempotencyKey).HasColumnName("idempotency_key").IsRequired();
            entity.Property(e => e.Status).HasColumnName("status").HasConversion<string>().HasMaxLength(16).IsRequired();
            entity.Property(e => e.Result).HasColumnName("result");
            entity.Property(e => e.Attempts).HasColumnName("attempts").IsRequired();
            entity.Property(e => e.StartedAt).HasColumnName("started_at").IsRequired();
            entity.Property(e => e.CompletedAt).HasColumnName("completed_at");
            entity.Property(e => e.Reason).HasColumnName("reason");
            entity.HasIndex(e => e.StartedAt).HasDatabaseName("ix_recorded_steps_started_at");
        });
        return modelBuilder;
    }

    /// <summary>
    /// Maps <c>outbox_messages</c>: <c>sequence</c> (identity, primary key, the order of creation), <c>message_id uuid</c>
    /// (unique; becomes the broker message id), <c>message_type</c>, <c>body</c>, <c>headers</c>, <c>destination</c>,
    /// <c>created_at</c>, <c>dispatched_at</c>, <c>attempts</c>, <c>last_error</c>, <c>next_attempt_at</c>; partial index
    /// <c>ix_outbox_messages_pending</c> on <c>sequence</c> where <c>dispatched_at is null</c>, so the dispatcher finds
    /// pending rows without scanning dispatched ones. Then add a migration (<c>dotnet ef migrations add AddExactlyOnceOutbox</c>).
    /// </summary>
    public static ModelBuilder AddExactlyOnceOutbox(this ModelBuilder modelBuilder, string? schema = null)
    {
        ArgumentNullException.ThrowIfNull(modelBuilder);
        modelBuilder.Entity<OutboxMessage>(entity =>
        {
            entity.ToTable(OutboxTableName, schema);
            entity.HasKey(e => e.Sequence).HasName("pk_outbox_messages");
            entity.Property(e => e.Sequence).HasColumnName("sequence").ValueGeneratedOnAdd();
            entity.Property(e => e.MessageId).HasColumnName("message_id").IsRequired();
            entity.Property(e => e.MessageType).HasColumnName("message_type").HasMaxLength(1000).IsRequired();
            entity.Property(e => e.Body).HasColumnName("body").IsRequired();
            entity.Property(e => e.Headers).HasColumnName("headers");
            entity.Property(e => e.Destination).HasColumnName("destination").HasMaxLength(1000);
            entity.Property(e => e.CreatedAt).HasColumnName("created_at").IsRequired();
            entity.Property(e => e.DispatchedAt).HasColumnName("dispatched_at");
            entity.Property(e => e.Attempts).HasColumnName("attempts").IsRequired();
            entity.Property(e => e.LastError).HasColumnName("last_error");
            entity.Property(e => e.NextAttemptAt).HasColumnName("next_attempt_at");
            entity.HasIndex(e => e.MessageId).IsUnique().HasDatabaseName("ux_outbox_messages_message_id");
            entity.HasIndex(e => e.Sequence)
                .HasDatabaseName("ix_outbox_messages_pending")
                .HasFilter("dispatched_at IS NULL");
            entity.HasIndex(e => e.DispatchedAt)
                .HasDatabaseName("ix_outbox_messages_dispatched_at")
                .HasFilter("dispatched_at IS NOT NULL");
        });
        return modelBuilder;
    }

    /// <summary>
    /// Maps <c>inbox_messages</c>: <c>id uuid</c>, <c>consumer_type varchar(500)</c>, <c>received_at timestamptz</c>,
    /// <c>processed_at timestamptz null</c>; primary key <c>pk_inbox_messages (id, consumer_type)</c>; partial index
    /// <c>ix_inbox_messages_unprocessed</c> on <c>received_at</c> where <c>processed_at is null</c>; and, for the
    /// retention cleanup, <c>ix_inbox_messages_processed_at</c> on <c>processed_at</c> where it is not null. Column and table
    /// names are fixed, whatever naming convention the rest of the model uses. Call it from <c>OnModelCreating</c>,
    /// then add a migration (<c>dotnet ef migrations add AddExactlyOnceInbox</c>).
    /// </summary>
    /// <param name="modelBuilder">The model builder of your DbContext.</param>
    /// <param name="schema">The database schema, or <see langword="null"/> for the default.</param>
    public static ModelBuilder AddExactlyOnceInbox(this ModelBuilder modelBuilder, string? schema = null)
    {
        ArgumentNullException.ThrowIfNull(modelBuilder);
        modelBuilder.Entity<InboxMessage>(entity =>
        {
            entity.ToTable(InboxTableName, schema);
            entity.HasKey(e => new { e.Id, e.ConsumerType }).HasName("pk_inbox_messages");
            entity.Property(e => e.Id).HasColumnName("id").ValueGeneratedNever();
            entity.Property(e => e.ConsumerType).HasColumnName("consumer_type").HasMaxLength(ExactlyOnceOptions.MaxConsumerNameLength).IsRequired();
            entity.Property(e => e.ReceivedAt).HasColumnName("received_at").IsRequired();
            entity.Property(e => e.ProcessedAt).HasColumnName("processed_at");
            entity.HasIndex(e => e.ReceivedAt)
                .HasDatabaseName("ix_inbox_messages_unprocessed")
                .HasFilter("processed_at IS NULL");
            // Beyond the requested schema, with reason: the retention cleanup finds old processed rows through this
            // index instead of scanning the table (docs/operations.md shows the plan and the cost on insert).
            entity.HasIndex(e => e.ProcessedAt)
                .HasDatabaseName("ix_inbox_messages_processed_at")
                .HasFilter("processed_at IS NOT NULL");
        });
        return modelBuilder;
    }
}
