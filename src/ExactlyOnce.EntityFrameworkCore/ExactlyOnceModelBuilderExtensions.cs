using ExactlyOnce;
using ExactlyOnce.EntityFrameworkCore;

namespace Microsoft.EntityFrameworkCore;

/// <summary>Adds the ExactlyOnce tables to your own <see cref="DbContext"/> model, so they commit with your data.</summary>
public static class ExactlyOnceModelBuilderExtensions
{
    /// <summary>The inbox table's name.</summary>
    public const string InboxTableName = "inbox_messages";

    /// <summary>
    /// Maps <c>inbox_messages</c>: <c>id uuid</c>, <c>consumer_type varchar(500)</c>, <c>received_at timestamptz</c>,
    /// <c>processed_at timestamptz null</c>; primary key <c>pk_inbox_messages (id, consumer_type)</c>; partial index
    /// <c>ix_inbox_messages_unprocessed</c> on <c>received_at</c> where <c>processed_at is null</c>. Column and table
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
        });
        return modelBuilder;
    }
}
